-- PATCH /v1/fleet/positions: each request BATCH (default 1000) positions of random drivers
-- among DRIVERS ("D%06d" ids), every one with a newer ts than any before it (none stale).
local drivers, batch, tick = 0, 0, 0
local base = 1796112000 -- 2026-12-01T08:00:00Z
init = function(args)
  drivers = tonumber(os.getenv("DRIVERS") or "100000")
  batch = tonumber(os.getenv("BATCH") or "1000")
  math.randomseed(os.time() + math.floor(os.clock() * 1e6))
end
request = function()
  local rows = {}
  for j = 1, batch do
    tick = tick + 1
    local ts = os.date("!%Y-%m-%dT%H:%M:%S", base + math.floor(tick / 1000))
    rows[j] = string.format(
      '{"driver_id":"D%06d","lat":%.6f,"lng":%.6f,"ts":"%s.%03dZ"}',
      math.random(0, drivers - 1), 31.0 + math.random() * 0.4, 121.2 + math.random() * 0.5,
      ts, tick % 1000)
  end
  local body = '{"positions":[' .. table.concat(rows, ",") .. ']}'
  return wrk.format("PATCH", "/v1/fleet/positions", {["Content-Type"] = "application/json"}, body)
end
