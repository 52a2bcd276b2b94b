-- lua/ulysses/paths.lua — file-system paths without a shell: realpath (links, '.' and '..'
-- resolved) for comparing paths, as train.lua and datasets/prepare.lua do before they move or
-- write anything. Needs only the FFI, not the library.
local ffi = require 'ffi'

pcall(ffi.cdef, 'char *realpath(const char *path, char *resolved);')
pcall(ffi.cdef, 'void free(void *p);')

local M = {}

-- path resolved; nil where it does not exist (path .. '/': nil unless a directory)
function M.realpath(path)
  local p = ffi.C.realpath(path, nil)
  if p == nil then return nil end
  local s = ffi.string(p)
  ffi.C.free(p)
  return s
end

return M
