"""Server-side scripts of the Redis store: each runs atomically, so that a promotion, a deletion
and a live update never interleave half-way.

The invariants they keep (``P`` the prefix, ``v`` a version):

* a version is *complete* while it is in ``P:versions`` and ``P:v:<v>:meta`` exists;
* ``current`` only ever names a complete version (``PROMOTE`` checks, ``FORGET`` refuses the
  current version);
* deletion ``FORGET``s first (registry entry, meta, generation: the version is gone for every
  reader and writer at once), then unlinks the remaining keys; so a reader that finds the meta
  *after* reading rows read real rows, never the hole of a half-deleted version;
* a row gather (``GATHER``) checks the version exists in the same script that reads its rows;
* a live update writes only into a complete version and bumps its generation in the same
  script (``UPDATE_ROWS``, ``UPDATE_DENSE``): it can never recreate keys of a deleted version.
"""

PROMOTE = """
-- KEYS: current, versions, meta of v; ARGV: v.  -> 1, or 0 when v is not complete
if redis.call('ZSCORE', KEYS[2], ARGV[1]) and redis.call('EXISTS', KEYS[3]) == 1 then
  redis.call('SET', KEYS[1], ARGV[1])
  return 1
end
return 0
"""

FORGET = """
-- KEYS: current, versions, incomplete, meta of v, generation of v; ARGV: v
-- -> 1 (forgotten), 0 (v is current: refused)
if redis.call('GET', KEYS[1]) == ARGV[1] then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[4], KEYS[5])
return 1
"""

UPDATE_ROWS = """
-- KEYS: meta, generation, stream, then H id-map overlay hashes, then their H change counters
-- (each INCRed by a push that writes its overlay: a fold checks it), then the blocks (rows, owners)
-- ARGV: maxlen, n_fields, field/value pairs of the stream entry (n_fields of them), H, then
--       per hash: n_pairs, id/row pairs; then per block: its length in bytes, n_rows,
--       offset/bytes pairs.
-- -> the new generation, or -1 (no version). A block not there yet (no row of it was
-- published) is created all ABSENT bytes first, so its other rows still read as absent.
-- Rows, owners and map entries of one push change together: a reader's gather of a row and
-- its owner (one GATHER call) sees both before or both after.
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local g = redis.call('INCR', KEYS[2])
local pos = 2
local entry = {'g', g}
local n = tonumber(ARGV[pos])
for i = 1, n do
  entry[#entry + 1] = ARGV[pos + 2 * i - 1]
  entry[#entry + 1] = ARGV[pos + 2 * i]
end
pos = pos + 2 * n + 1
local hashes = tonumber(ARGV[pos])
pos = pos + 1
for h = 1, hashes do
  local count = tonumber(ARGV[pos])
  pos = pos + 1
  for i = 1, count do
    redis.call('HSET', KEYS[3 + h], ARGV[pos], ARGV[pos + 1])
    pos = pos + 2
  end
  if count > 0 then redis.call('INCR', KEYS[3 + hashes + h]) end
end
for k = 4 + 2 * hashes, #KEYS do
  local size = tonumber(ARGV[pos])
  local rows = tonumber(ARGV[pos + 1])
  pos = pos + 2
  if redis.call('EXISTS', KEYS[k]) == 0 then
    redis.call('SET', KEYS[k], string.rep('\\255', size))
  end
  for i = 1, rows do
    redis.call('SETRANGE', KEYS[k], ARGV[pos], ARGV[pos + 1])
    pos = pos + 2
  end
end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[1], '*', unpack(entry))
return g
"""

COMPACT = """
-- KEYS: meta, id-map base, its overlay hash, the overlay's change counter; ARGV: the overlay's
-- entries and its counter when it was read, the folded base.  -> 1 (folded), 0 (a push wrote
-- the overlay meanwhile, from any writer: the servers of a table split by rows each push to
-- it; left), -1 (no version)
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HLEN', KEYS[3]) ~= tonumber(ARGV[1]) then return 0 end
if (redis.call('GET', KEYS[4]) or '0') ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[2], ARGV[3])
redis.call('DEL', KEYS[3])
return 1
"""

GATHER = """#!lua flags=no-writes
-- KEYS: meta of v, then one row block per row asked for; ARGV: per block, the row's first
-- byte and its length.  -> the rows concatenated (ABSENT bytes for a row of a block that does
-- not exist), or nil when v is gone. Read-only (EVALSHA_RO): replicas and read-only users run it.
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local out = {}
for i = 2, #KEYS do
  local first = tonumber(ARGV[2 * i - 3])
  local width = tonumber(ARGV[2 * i - 2])
  local row = redis.call('GETRANGE', KEYS[i], first, first + width - 1)
  if #row ~= width then row = string.rep('\\255', width) end
  out[i - 1] = row
end
return table.concat(out)
"""

UPDATE_DENSE = """
-- KEYS: meta, generation, stream, dense; ARGV: maxlen, weights.  -> generation, or -1
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local g = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[4], ARGV[2])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[1], '*', 'g', g, 'dense', '1')
return g
"""
