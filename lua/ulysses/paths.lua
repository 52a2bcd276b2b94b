-- lua/ulysses/paths.lua — files without a shell: realpath (links, '.' and '..' resolved) for
-- comparing paths, as train.lua and datasets/prepare.lua do before they move or write anything,
-- a whole file's bytes, a directory's names, and mkdir -p. Needs only the FFI, not the library.
local ffi = require 'ffi'

pcall(ffi.cdef, 'char *realpath(const char *path, char *resolved);')
pcall(ffi.cdef, 'void free(void *p);')
-- one declaration per cdef: another module may have declared some of them already
pcall(ffi.cdef, 'void *opendir(const char *name);')
pcall(ffi.cdef, 'int closedir(void *dirp);')
pcall(ffi.cdef, 'int mkdir(const char *path, unsigned int mode);')
pcall(ffi.cdef, 'void *readdir(void *dirp);')
pcall(ffi.cdef, [[
  struct uly_dirent_glibc { uint64_t d_ino; int64_t d_off; unsigned short d_reclen; unsigned char d_type;
                            char d_name[256]; };
]])

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

-- the names in dir ('.' and '..' included, in no order); nil when dir cannot be read
function M.list_dir(dir)
  local d = ffi.C.opendir(dir)
  if d == nil then return nil end
  local names = {}
  while true do
    local e = ffi.C.readdir(d)
    if e == nil then break end
    names[#names + 1] = ffi.string(ffi.cast('struct uly_dirent_glibc *', e).d_name)
  end
  ffi.C.closedir(d)
  return names
end

-- make dir and any missing parents (mkdir -p); existing ones are fine
function M.mkdir_p(dir)
  if dir == '' or M.list_dir(dir) then return end
  local prefix = dir:sub(1, 1) == '/' and '/' or ''
  for part in dir:gmatch('[^/]+') do
    prefix = prefix .. part
    ffi.C.mkdir(prefix, tonumber('755', 8))
    prefix = prefix .. '/'
  end
end

return M
