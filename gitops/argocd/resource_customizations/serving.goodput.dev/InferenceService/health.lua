-- Argo CD health of a Goodput InferenceService, read from the status the operator writes:
-- observedGeneration, replicas, readyReplicas and the conditions Valid, Available and Ready
-- (Available's reason says why no pod serves).
local hs = {}

local function condition(conditions, kind)
  if conditions == nil then
    return nil
  end
  for _, c in ipairs(conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

-- Why no pod serves, where the pods cannot recover by themselves; a rollout past its deadline too.
local failed = {
  RuntimeFailing = true,
  ContainerConfigError = true,
  ImagePullFailed = true,
  ProgressDeadlineExceeded = true,
  ChildConflict = true,
}

local status = obj.status
local generation = obj.metadata.generation or 0
if status == nil or status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report a status"
  return hs
end

local valid = condition(status.conditions, "Valid")
if valid ~= nil and valid.status == "False" and (status.observedGeneration or 0) >= generation then
  hs.status = "Degraded"
  hs.message = (valid.reason or "Invalid") .. ": " .. (valid.message or "the spec is not valid")
  return hs
end

if (status.observedGeneration or 0) < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. generation
  return hs
end

local available = condition(status.conditions, "Available")
local ready = condition(status.conditions, "Ready")
if available ~= nil and available.status == "False" then
  if available.reason == "ScaledToZero" then
    hs.status = "Suspended"
    hs.message = "Scaled to zero replicas"
    return hs
  end
  if failed[available.reason] then
    hs.status = "Degraded"
    hs.message = available.reason .. ": " .. (available.message or "")
    return hs
  end
end

if ready ~= nil and ready.status == "True" then
  local replicas = status.replicas or 0
  local readyReplicas = status.readyReplicas or 0
  if readyReplicas < replicas then
    hs.status = "Progressing"
    hs.message = "Serving; " .. readyReplicas .. "/" .. replicas .. " replicas ready"
    return hs
  end
  hs.status = "Healthy"
  hs.message = ready.message or "Serving"
  return hs
end

-- replicas starting, a model loading, pods waiting for a node
hs.status = "Progressing"
if available ~= nil then
  hs.message = (available.reason or "Pending") .. ": " .. (available.message or "")
elseif ready ~= nil then
  hs.message = (ready.reason or "Pending") .. ": " .. (ready.message or "")
else
  hs.message = "Waiting for the replicas"
end
return hs
