-- POST /v1/dispatch/recommend: an order near a random city centre (CENTRES: "lat,lng;..."),
-- within RADIUS km, k 10; the same 64 order texts repeat (their query vectors are cached).
local centres, radius = {}, 10
init = function(args)
  for lat, lng in string.gmatch(os.getenv("CENTRES"), "([%-%d%.]+),([%-%d%.]+)") do
    centres[#centres + 1] = {tonumber(lat), tonumber(lng)}
  end
  radius = tonumber(os.getenv("RADIUS") or "10")
  math.randomseed(os.time() + math.floor(os.clock() * 1e6))
end
request = function()
  local c = centres[math.random(#centres)]
  local body = string.format(
    '{"order_id":"o%d","pickup":{"lat":%.6f,"lng":%.6f},"radius_km":%g,"k":10}',
    math.random(0, 63), c[1] + (math.random() - 0.5) * 0.1, c[2] + (math.random() - 0.5) * 0.1,
    radius)
  return wrk.format("POST", "/v1/dispatch/recommend", {["Content-Type"] = "application/json"}, body)
end
