-- GET /healthz (the probe a load balancer sends), for its latency beside a load. GAP_MS: a
-- pause before each request on a connection (a probe is periodic; a closed loop of probes
-- would itself load the server it measures).
local gap = tonumber(os.getenv("GAP_MS") or "0")

request = function()
  return wrk.format("GET", "/healthz")
end

delay = function()
  return gap
end
