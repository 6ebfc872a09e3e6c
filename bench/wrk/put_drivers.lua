-- PUT /v1/fleet/drivers, cycling through the request bodies in the file BODIES (one a line).
local bodies = {}
init = function(args)
  for line in io.lines(os.getenv("BODIES")) do bodies[#bodies + 1] = line end
end
local i = 0
request = function()
  i = i % #bodies + 1
  return wrk.format("PUT", "/v1/fleet/drivers", {["Content-Type"] = "application/json"}, bodies[i])
end
