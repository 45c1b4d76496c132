"""Server-side scripts of the Redis store: each runs atomically, so that a promotion, a deletion
and a live update never interleave half-way.

The invariants they keep (``P`` the prefix, ``v`` a version):

* a version is *complete* while it is in ``P:versions`` and ``P:v:<v>:meta`` exists;
* ``current`` only ever names a complete version (``PROMOTE`` checks, ``FORGET`` refuses the
  current version);
* deletion ``FORGET``s first (registry entry, meta, generation: the version is gone for every
  reader and writer at once), then unlinks the remaining keys; so a reader that finds the meta
  *after* reading rows read real rows, never the hole of a half-deleted version;
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
-- KEYS: meta, generation, stream, then the row hashes
-- ARGV: maxlen, n_fields, field/value pairs of the stream entry (n_fields of them),
--       then per row hash: n_pairs, id/row pairs.   -> the new generation, or -1 (no version)
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
for k = 4, #KEYS do
  local pairs_ = tonumber(ARGV[pos])
  pos = pos + 1
  local chunk = {}
  for i = 1, pairs_ do
    chunk[#chunk + 1] = ARGV[pos]
    chunk[#chunk + 1] = ARGV[pos + 1]
    pos = pos + 2
    if #chunk >= 1000 then
      redis.call('HSET', KEYS[k], unpack(chunk))
      chunk = {}
    end
  end
  if #chunk > 0 then redis.call('HSET', KEYS[k], unpack(chunk)) end
end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[1], '*', unpack(entry))
return g
"""

UPDATE_DENSE = """
-- KEYS: meta, generation, stream, dense; ARGV: maxlen, weights.  -> generation, or -1
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local g = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[4], ARGV[2])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[1], '*', 'g', g, 'dense', '1')
return g
"""
