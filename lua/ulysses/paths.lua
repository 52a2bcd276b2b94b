-- lua/ulysses/paths.lua — files without a shell: realpath (links, '.' and '..' resolved) for
-- comparing paths, as train.lua and datasets/prepare.lua do before they move or write anything,
-- and a whole file's bytes. Needs only the FFI, not the library.
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

-- a file's bytes; nil where it cannot be read
function M.read_file(path)
  local f = io.open(path, 'rb')
  if not f then return nil end
  local s = f:read('*a')
  f:close()
  return s
end

return M
