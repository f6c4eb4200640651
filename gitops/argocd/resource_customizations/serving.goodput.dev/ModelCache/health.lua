-- Argo CD health of a Goodput ModelCache, read from the status the caching agents write: the phase
-- over every node (Pending, Downloading, Ready, Failed), nodesReady, progress and the last error,
-- which names the node and the file.
local hs = {}
local status = obj.status
local generation = obj.metadata.generation or 0
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for a caching agent to report a node"
  return hs
end
if (status.observedGeneration or 0) < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the agents to observe generation " .. generation
  return hs
end
if status.phase == "Failed" then
  hs.status = "Degraded"
  hs.message = status.lastError or "a node failed to cache the model"
  return hs
end
local nodes = status.nodesReady or "0/0"
if status.phase == "Ready" then
  hs.status = "Healthy"
  hs.message = "Cached on " .. nodes .. " nodes"
  return hs
end
hs.status = "Progressing"
hs.message = status.phase .. ": " .. (status.progress or "0%") .. ", " .. nodes .. " nodes ready, ETA " .. (status.eta or "-")
return hs
