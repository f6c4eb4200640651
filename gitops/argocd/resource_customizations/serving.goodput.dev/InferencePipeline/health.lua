-- Argo CD health of a Goodput InferencePipeline, read from the status the operator writes:
-- observedGeneration and the conditions Valid and Ready (Ready's reason names a missing or
-- not yet Ready InferenceService).
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
if status == nil or status.conditions == nil then
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
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message or "Serving"
  return hs
end
if ready ~= nil and ready.reason == "ServiceNotFound" then
  hs.status = "Degraded"
  hs.message = "ServiceNotFound: " .. (ready.message or "")
  return hs
end
hs.status = "Progressing"
hs.message = ready and ((ready.reason or "Pending") .. ": " .. (ready.message or "")) or "Waiting for its services"
return hs
