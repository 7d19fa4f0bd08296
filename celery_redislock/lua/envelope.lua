-- Prepended to handoff.lua and sweep.lua (see _scripts.PRELUDES): a parked broker envelope
-- is "E<queue list>\n<tag placeholder>\n<envelope JSON>" (task.envelope_entry). Returns the
-- queue list and the envelope as a hand-over pushes it: delivery tag "<placeholder>h<token>"
-- (unique, no JSON escaping needed, and the worker's main process knows it for a hand-over).
local function pushed_envelope(message, token)
  local first = string.find(message, '\n', 1, true)
  local second = string.find(message, '\n', first + 1, true)
  local placeholder = string.sub(message, first + 1, second - 1)  -- "rltag" + random hex
  local envelope = string.sub(message, second + 1)
  local at = string.find(envelope, placeholder, 1, true)  -- plain find: no pattern escapes
  return string.sub(message, 2, first - 1),
    string.sub(envelope, 1, at - 1) .. placeholder .. 'h' .. token .. string.sub(envelope, at + #placeholder)
end

