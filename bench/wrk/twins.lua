-- POST /v1/embeddings of 32 new texts, the SAME sequence in every wrk thread: each request's
-- texts are new to the server, and the other threads send them at about the same moment
-- (in flight together: coalesced, or computed twice if they reach different engines).
local FMT = os.getenv("FMT") or "base64"
local SALT = os.getenv("SALT") or ""
local n = 0
request = function()
  n = n + 1
  local parts = {}
  for j = 0, 31 do parts[#parts + 1] = string.format('"twin van %s%d-%d capacity %d kg"', SALT, n, j, (n * 7 + j) % 5000) end
  local body = '{"input":[' .. table.concat(parts, ",") .. '],"encoding_format":"' .. FMT .. '"}'
  return wrk.format("POST", "/v1/embeddings", {["Content-Type"] = "application/json"}, body)
end
