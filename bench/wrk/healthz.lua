-- GET /healthz (the probe a load balancer sends), for its latency beside a load.
request = function()
  return wrk.format("GET", "/healthz")
end
