-- Argo CD health of a Goodput LoraAdapter, read from the status the operator writes: observedGeneration,
-- the phase (Pending, Loading, Ready, Failed) and the conditions Valid and Ready.
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

local status = obj.status
local generation = obj.metadata.generation or 0
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report a status"
  return hs
end
if (status.observedGeneration or 0) < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. generation
  return hs
end

local valid = condition(status.conditions, "Valid")
if valid ~= nil and valid.status == "False" then
  hs.status = "Degraded"
  hs.message = (valid.reason or "Invalid") .. ": " .. (valid.message or "the spec is not valid")
  return hs
end
local ready = condition(status.conditions, "Ready")
if status.phase == "Failed" then
  hs.status = "Degraded"
  hs.message = ((ready and ready.reason) or "Failed") .. ": " .. (status.lastError or "")
  return hs
end
if status.phase == "Ready" then
  hs.status = "Healthy"
  hs.message = (ready and ready.message) or "Loaded"
  return hs
end
hs.status = "Progressing"
hs.message = status.phase .. ((ready and (": " .. (ready.message or ""))) or "")
return hs
