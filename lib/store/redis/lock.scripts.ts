/**
 * The Redis data model of nestjs-locked, and every Lua script that touches it.
 *
 * For a lock with key K and the module's prefix P (default `lock:`):
 *
 * | Redis name      | type    | content                                         | lifetime                                    |
 * |-----------------|---------|-------------------------------------------------|---------------------------------------------|
 * | `P{K}`          | hash    | field = owner id, value = that owner's holds    | PEXPIRE = the lease; deleted at last release |
 * | `P{K}:fence`    | string  | the last fencing token issued for K             | PEXPIRE the counter lifetime (`fencingCounterTtlMs`, default `FENCE_COUNTER_TTL_MS`) after each grant |
 * | `P{K}:queue`    | list    | fair mode: owners waiting, first come first served | PEXPIRE 2 x the queue timeout, refreshed by every attempt |
 * | `P{K}:queue:timeouts` | zset | fair mode: owner -> Redis-clock ms after which it has left the queue | as the queue |
| `P{K}:queue:leases` | hash | fair mode: owner -> `<lease ms> <wait id>`: the lease to hand it the lock with, and which of its waits asked | as the queue |
 * | `P{K}:writers`  | zset    | read-write mode: writers waiting -> Redis-clock ms until their place lapses | PEXPIRE 2 x the queue timeout |
 * | channel `P{K}`  | pub/sub | a message on every release: `released` (wake one), `all` (wake every waiter: read-write releases, force-unlocks, a lease set shorter), or `granted <token> <wait id> <owner>` (a fair handover) | - |
 *
 * The scripts publish with `redis.pcall`: a publish Redis refuses (an ACL user without these
 * channels: Redis 7 and later, and Valkey, give a user created with ACL SETUSER none unless
 * granted) only leaves waiters to retry, and never fails the release it follows, whose writes Redis
 * has already made (a Lua error does not undo them). `PUBLISH_CHECK` tells the store at bootstrap, which warns.
 *
 * Every name of one lock starts with the same `{K}` hash tag, so on Redis Cluster they share a slot
 * (keys never contain braces; see `assertLockKey`). The channel name is passed to the scripts as an
 * argument rather than derived from KEYS, so an ioredis `keyPrefix` on the client (which prefixes
 * KEYS but not channels) cannot separate publisher from subscriber.
 *
 * Fair mode: a waiter enters the queue on its first refused attempt and refreshes its place on every
 * attempt; a place not refreshed within the queue timeout (the waiter crashed or gave up silently)
 * is dropped by the next script that looks at the queue. All deadlines are on Redis's clock (TIME).
 * A release that frees the lock hands it over inside the same script: the first live waiter
 * becomes the holder (hold count 1, a fresh fencing token, the lease it registered, at most its
 * queue timeout), the hash field `:handed` = `<wait id> <owner>` names its wait, and
 * `granted <token> <wait id> <owner>` is published (and returned to the releaser, which wakes the
 * waiter itself when it is in the same process), so the waiter holds the lock without another
 * round trip. A waiter that missed the message finds `:handed` naming its wait on its next attempt
 * and takes the grant as its own (it does not re-enter); one that gave up meanwhile gives it back
 * when it leaves the queue; one that crashed holds it until that short lease ends. `:handed` goes
 * with the holder's last hold. Naming the wait, not only the owner, keeps the acquisitions of an
 * owner apart: another task or process acquiring under the owner token re-enters (a hold of its
 * own), and the waiter's attempt, or its leave, still finds the handed hold as its own.
 *
 * Read-write mode: the same hash holds write holds in field `owner` (so a plain exclusive lock and a
 * write lock exclude each other), read holds in field `owner:read`, and `:mode` = `read` while
 * only readers hold it. A writer may also take the read lock (downgrade); a reader asking for the
 * write lock is refused at once (-1). A refused writer registers in `P{K}:writers`; while a writer
 * waits there, new readers are refused (re-entrant readers are not), so readers cannot starve it.
 * Releases of read-write locks announce `all`: every waiter retries, and readers go in together.
 *
 * Fencing tokens: `max(counter + 1, server time in microseconds)`. Seeding from Redis's own clock
 * keeps tokens increasing after the counter expired, was lost in a restart without persistence, or
 * lagged on a promoted replica, as long as Redis's clock does not step back by more than the
 * counter's idle lifetime. Tokens stay below 2^53 (exact in JavaScript) until the year 2255.
 *
 * Scripts return integers, strings, or arrays of them (never Lua booleans), so replies read the
 * same over RESP2 (ioredis 5) and RESP3 (ioredis 6).
 */

/** How long a fencing counter outlives the last grant of its key, unless `fencingCounterTtlMs` says otherwise. */
export const FENCE_COUNTER_TTL_MS = 3_600_000;

/**
 * The lease a fair waiter that registered none (queued by an older version) is handed a lock with:
 * DEFAULT_FAIR_QUEUE_TIMEOUT_MS, written out because this module imports nothing (bench tools load
 * it from earlier commits on its own).
 */
const FALLBACK_HANDOVER_LEASE_MS = 5_000;

/**
 * Lua fragment: the next fencing token of the counter `fence` into local `token` (a string of
 * digits), the counter set to it (lifetime ARGV[3]). `time` is a Redis TIME reply. One SET ... GET
 * in the usual case (the clock is ahead of the counter); a second SET only when the counter is ahead
 * of the clock. The token is written by joining TIME's digits, not with string.format: Lua formats
 * numbers with sprintf, which costs Redis more than the SET itself. A lifetime of `0` keeps no
 * counter and issues token 0: the nodes of a Redlock quorum, whose tokens are never used.
 */
function nextToken(time: string, lifetime = 'ARGV[3]'): string {
  return `local token = '0'
  if ${lifetime} ~= '0' then
    token = ${time}[1] .. string.rep('0', 6 - #${time}[2]) .. ${time}[2]
    local last = redis.call('set', fence, token, 'px', ${lifetime}, 'get')
    if last and tonumber(last) >= tonumber(token) then
      token = string.format('%.0f', tonumber(last) + 1)
      redis.call('set', fence, token, 'px', ${lifetime})
    end
  end`;
}

/**
 * Lua statement: set `key`'s expiry to `ms` unless it already ends later. The waiting places of
 * a lock share one key, and a waiter whose place timeout is shorter (another service's
 * `fairQueueTimeoutMs`) must not cut the places of the waiters with longer ones.
 */
function lengthen(key: string, ms: string): string {
  return `if redis.call('pttl', ${key}) < ${ms} then redis.call('pexpire', ${key}, ${ms}) end`;
}

/**
 * Lua fragment: grant a free lock to `owner` with a fresh fencing token and return. `timeExpr`
 * yields Redis TIME ({seconds, microseconds}); it is not evaluated when the counter's lifetime
 * ARGV[3] is `0` (no tokens: TIME is one of the dearest calls a grant makes). Expects locals lock,
 * fence, owner, lease.
 */
function grantFresh(timeExpr: string): string {
  return `local now = ARGV[3] ~= '0' and ${timeExpr}
  ${nextToken('now')}
  redis.call('hset', lock, owner, '1')
  redis.call('pexpire', lock, ARGV[2])
  return {1, 1, tonumber(token)}`;
}

/** Lua expression: the latest fencing token of `fence` (0 when none, or when the counter's lifetime ARGV[3] is `0`: no tokens, nothing read). */
const currentToken = `(ARGV[3] ~= '0' and tonumber(redis.call('get', fence) or '0') or 0)`;

/**
 * Lua fragment: lengthen the lock's lease to ARGV[2] ms (local `lease`, its number), never
 * shortening it: the lock's other holds count on the lease as it is. A lock without expiry (not
 * ours) is left without. PEXPIRE gets the ARGV string, not the Lua number (see RENEW). Expects locals lock, lease.
 */
const lengthenLease = `local ttl = redis.call('pttl', lock)
if ttl >= 0 and ttl < lease then redis.call('pexpire', lock, ARGV[2]) end`;

/** Lua fragment: if hash field `field` (a Lua expression) holds the lock, take one more hold (never shortening the lease) and return. */
const reenterAs = (field: string) => `if redis.call('hexists', lock, ${field}) == 1 then
  local holds = redis.call('hincrby', lock, ${field}, '1')
  ${lengthenLease}
  return {1, holds, ${currentToken}}
end`;

/** Lua fragment: if `owner` holds the lock, take one more hold (never shortening the lease) and return. */
const reenter = reenterAs('owner');


/**
 * Lua expression: whether the lock was handed to the wait `waitId` of `owner` and not taken over
 * yet. The mark `:handed` is `<wait id> <owner>`: it names the wait whose place the release found,
 * and only that wait takes it as its grant. It may take it from the message, without a round trip
 * (the mark stays, with the hold, until the owner's last release); a wait that did never sends an
 * attempt or a leave again, so a mark naming the wait that asks is never taken twice. A place
 * registered before its wait watched the channel has no wait id (mark `' ' .. owner`): no waiter
 * takes such a grant from the message, and the first fair acquisition of the owner to ask takes it
 * (and drops the mark). Any other acquisition of the owner (another wait or task of the caller's
 * process, a wait of another process under a shared owner token, a fresh one) re-enters instead,
 * adding a hold of its own, and leaves the mark to the wait it names. Expects locals lock, owner.
 */
function handedTo(waitId: string): string {
  return `(function(mark) return mark == ${waitId} .. ' ' .. owner or mark == ' ' .. owner end)(redis.call('hget', lock, ':handed'))`;
}

/** Lua fragment: `nowMs` from the TIME reply `t`, and the fair queue's lapsed places dropped. Expects locals queue, timeouts, leases. */
const pruneQueue = `local nowMs = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for _, gone in ipairs(redis.call('zrangebyscore', timeouts, '-inf', nowMs)) do
  redis.call('lrem', queue, 0, gone)
  redis.call('zrem', timeouts, gone)
  redis.call('hdel', leases, gone)
end`;

/**
 * Lua fragment: \`handOver(t, channel, publisher, lifetime)\` gives a free lock to the first live waiter of the
 * fair queue and announces it with \`granted <token> <wait id> <owner>\`; returns {token, wait id,
 * owner}, or false when nobody waits. \`t\` is a TIME reply, \`lifetime\` the fencing counter's in ms. Expects locals lock and queue; the
 * queue's timeouts and leases and the fencing counter are named from them (same hash tag, so the
 * same Cluster slot): a release, which hands over rarely, sends two keys instead of five.
 */
const handOver = `local function handOver(t, channel, publisher, lifetime)
  local timeouts, leases, fence = queue .. ':timeouts', queue .. ':leases', lock .. ':fence'
  ${pruneQueue}
  local head = redis.call('lpop', queue)
  if not head then return false end
  redis.call('zrem', timeouts, head)
  local handoverLease, waitId = ${FALLBACK_HANDOVER_LEASE_MS}, ''
  local place = string.match(redis.call('hget', leases, head) or '', '^%d+ %S*$')
  if place then handoverLease, waitId = string.match(place, '^(%d+) (%S*)$') end
  redis.call('hdel', leases, head)
  ${nextToken('t', 'lifetime')}
  redis.call('hset', lock, head, '1', ':handed', waitId .. ' ' .. head)
  redis.call('pexpire', lock, handoverLease)
  redis.pcall(publisher, channel, 'granted ' .. token .. ' ' .. waitId .. ' ' .. head)
  return {token, waitId, head}
end`;

/**
 * Lua fragment, for scripts whose KEYS are {lock, queue} and ARGV {_, channel, publisher} (and the
 * fencing counter's lifetime in the argument \`lifetime\` names): if the lock is free now,
 * hand it to the fair queue's first live waiter (local `handed` = what handOver returned), else
 * announce \`announce\` (\`released\`, or \`all\`) on ARGV[2] with ARGV[3] (publish or spublish). Holders drop `:handed` with
 * their own field (HDEL of both), so a free lock is a deleted hash. One EXISTS counts both names:
 * 0 is the usual release (free, nobody queued); 1 is told apart (still held, or free with a queue)
 * by a second EXISTS.
 */
const freed = (lifetime: string, announce: 'released' | 'all' = 'released') => `local handed = false
local present = redis.call('exists', lock, queue)
if present == 0 or (present == 1 and redis.call('exists', lock) == 0) then
  if present == 1 then handed = handOver(redis.call('time'), ARGV[2], ARGV[3], ${lifetime}) end
  if not handed then redis.pcall(ARGV[3], ARGV[2], '${announce}') end
end`;

/** Lua prologue of the scripts that use `freed`. */
const freedKeys = `local lock, queue = KEYS[1], KEYS[2]
${handOver}`;

/**
 * Take the lock, or re-enter it.
 * KEYS[1] lock hash, KEYS[2] fencing counter.
 * ARGV[1] owner, ARGV[2] lease in ms, ARGV[3] counter lifetime in ms.
 * Returns {1, holdCount, fencingToken} when granted (re-entry keeps the token of the current grant),
 * or {0, remaining lease of the holder in ms (-1: no expiry)}.
 * A re-entry never shortens the lease: it becomes max(remaining, ARGV[2]).
 */
export const ACQUIRE = `
local lock, fence, owner, lease = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2])
if redis.call('exists', lock) == 0 then
  ${grantFresh('redis.call(\'time\')')}
end
${reenter}
return {0, redis.call('pttl', lock)}
`;

/**
 * Fair variant of ACQUIRE: first come, first served across processes.
 * KEYS[1] lock hash, KEYS[2] fencing counter, KEYS[3] queue, KEYS[4] queue timeouts, KEYS[5] queue leases.
 * ARGV[1] owner, ARGV[2] lease in ms, ARGV[3] counter lifetime in ms, ARGV[4] queue timeout in ms,
 * ARGV[5] the lease to be handed the lock with, ARGV[6] release channel, ARGV[7] publish command,
 * ARGV[8] the caller's wait id ('' before it watches the channel), echoed in the handover message.
 * Returns as ACQUIRE. A lock handed to this wait and not taken over yet (see handedTo) is returned
 * as a grant of the hold the handover gave, with the handover's token and the lease lengthened to
 * ARGV[2] (never shortened: holds taken meanwhile by other acquisitions of the owner, re-entries
 * that leave the mark, stay theirs with their lease, so the count stays one per hold). When
 * refused, the owner is in the queue (or its place refreshed); the reply is {0,
 * the holder's remaining lease, the latest fencing token of the key}: a handover message with a
 * token up to that one was issued before this attempt, so it is void. A free lock whose queue has
 * an earlier live waiter is handed to that waiter first.
 */
export const ACQUIRE_FAIR = `
local lock, fence, queue, timeouts, leases = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local owner, lease, queueTimeout = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[4])
${handOver}
if ${handedTo('ARGV[8]')} then
  redis.call('hdel', lock, ':handed')
  ${lengthenLease}
  return {1, tonumber(redis.call('hget', lock, owner)), ${currentToken}}
end
${reenter}
local t = redis.call('time')
${pruneQueue}
local head = redis.call('lindex', queue, 0)
if redis.call('exists', lock) == 0 then
  if not head or head == owner then
    if head then
      redis.call('lpop', queue)
      redis.call('zrem', timeouts, owner)
      redis.call('hdel', leases, owner)
    end
    ${grantFresh('t')}
  end
  handOver(t, ARGV[6], ARGV[7], ARGV[3])
end
if redis.call('zadd', timeouts, nowMs + queueTimeout, owner) == 1 then redis.call('rpush', queue, owner) end
redis.call('hset', leases, owner, ARGV[5] .. ' ' .. ARGV[8])
for _, k in ipairs({queue, timeouts, leases}) do ${lengthen('k', '2 * queueTimeout')} end
return {0, redis.call('pttl', lock), ${currentToken}}
`;

/**
 * Leave the fair queue (a waiter gave up or was aborted, or read its handover too late), and give
 * back a lock handed to this wait and not taken over (see handedTo): its mark and the one hold the
 * handover gave, so the holds other acquisitions of the owner took meanwhile (other tasks of the
 * caller's process, other processes of a shared owner token) stay. A free lock goes to the next
 * live waiter.
 * KEYS[1] lock hash, KEYS[2] queue (its timeouts and leases are named from it).
 * ARGV[1] owner, ARGV[2] channel, ARGV[3] publish command, ARGV[4] fencing counter lifetime in ms
 * (for a lock it hands over), ARGV[5] the caller's wait id ('' before it watched the channel).
 * Returns 1 when the owner was queued, else 0.
 */
export const LEAVE_QUEUE = `
${freedKeys}
local timeouts, leases, owner = queue .. ':timeouts', queue .. ':leases', ARGV[1]
local queued = redis.call('zrem', timeouts, owner) == 1
if queued then
  redis.call('lrem', queue, 0, owner)
  redis.call('hdel', leases, owner)
end
local given = ${handedTo('ARGV[5]')}
if given then
  redis.call('hdel', lock, ':handed')
  if redis.call('hincrby', lock, owner, -1) <= 0 then redis.call('del', lock) end
end
if not queued and not given then return 0 end
${freed('ARGV[4]')}
if queued then return 1 end
return 0
`;

/**
 * Drop one hold.
 * KEYS[1] lock hash, KEYS[2] fair queue.
 * ARGV[1] owner, ARGV[2] release channel, ARGV[3] publish command (`publish` or `spublish`),
 * ARGV[4] fencing counter lifetime in ms (for a lock it hands to a fair waiter), ARGV[5] `1` when
 * the caller still holds the lock after this release (it gives back one hold of several; see keepLastHold).
 * Returns the owner's holds left: 0 means the lock was deleted and the release announced;
 * {0, token, wait id, owner} that it was handed to that fair waiter; -1 means the owner held
 * nothing, and nothing was changed.
 */
export const RELEASE = releaseScript('', keepLastHold('ARGV[5]'));

/**
 * A release that gives back one hold of several never frees the lock: when Redis counts the
 * holder's last hold (the field's holds are 1 here), it is kept and the release returns 1, changing
 * nothing. Redis counts fewer holds than the caller when a release ran twice (ioredis sends a
 * command again when its connection closed before the reply came, see RedisLockStore's `resent`),
 * and freeing the lock then would let another owner in under the caller's other holds.
 * `flag`: the argument that is `1` when the caller still holds the lock after this release.
 */
function keepLastHold(flag: string): string {
  return `if ${flag} == '1' then return 1 end\n`;
}

/**
 * The release scripts; `handTo`: Lua run once the owner's last hold is gone, before the lock is
 * announced free; `keep`: Lua run when the owner has one hold left, before it is dropped.
 */
function releaseScript(handTo: string, keep = ''): string {
  return `
${freedKeys}
local owner = ARGV[1]
local holds = redis.call('hget', lock, owner)
if not holds then return -1 end
if tonumber(holds) > 1 then return redis.call('hincrby', lock, owner, -1) end
${keep}-- Redis deletes a hash when its last field goes, so an empty lock no longer exists.
redis.call('hdel', lock, owner, ':handed')
${handTo}${freed('ARGV[4]')}
if handed then return {0, handed[1], handed[2], handed[3]} end
return 0
`;
}

/**
 * RELEASE that hands a lock it frees to a waiter of the releasing process (default mode): when the
 * release frees the lock and no fair queue waits for it, `ARGV[5]` becomes the holder (hold count
 * 1, lease `ARGV[6]` ms, a fresh fencing token with the counter lifetime `ARGV[7]`, as ACQUIRE
 * grants a free lock) and `released` is announced as RELEASE announces it. The waiter need not send
 * an attempt of its own: the reply tells it.
 * KEYS and ARGV[1..4] as RELEASE; ARGV[5] the waiter's owner, ARGV[6] its lease in ms, ARGV[7] the
 * counter lifetime of its grant in ms (`0`: no token).
 * Returns as RELEASE, or {0, fencingToken} when the lock was handed to ARGV[5].
 */
export const RELEASE_TO = releaseScript(`if redis.call('exists', lock, queue) == 0 then
  local fence, t = lock .. ':fence', ARGV[7] ~= '0' and redis.call('time')
  ${nextToken('t', 'ARGV[7]')}
  redis.call('hset', lock, ARGV[5], '1')
  redis.call('pexpire', lock, ARGV[6])
  redis.pcall(ARGV[3], ARGV[2], 'released')
  return {0, tonumber(token)}
end
`);
/**
 * Drop every hold of an owner of an exclusive lock (after a loss, at shutdown).
 * KEYS and ARGV as RELEASE. Returns 1 when the owner held the lock, else 0.
 */
export const RELEASE_ALL = `
${freedKeys}
local owner = ARGV[1]
if redis.call('hdel', lock, owner, ':handed') == 0 then return 0 end
${freed('ARGV[4]')}
return 1
`;

/**
 * Undo what a lock step did twice: ioredis sends a command again when its connection closed before
 * the reply came, so Redis may have run it once before the run whose reply the caller reads (see
 * RedisLockStore's \`resent\`). Adds ARGV[2] (1 or -1) to the holds of field ARGV[1] when they are
 * ARGV[3] (what the step's reply said), only while that field keeps at least one hold: it never
 * frees a lock, and never touches a lock the field does not hold. Holds already at ARGV[3] + ARGV[2]
 * are left as they are: this script ran before (it too is sent again after a dropped connection),
 * and a second run must not add the difference twice. Holds at neither (another step of the field
 * ran since the reply) are left as they are too.
 * KEYS[1] lock hash. Returns the holds after; -1 when the field holds nothing, -2 when the holds
 * were at neither, and nothing was changed.
 */
export const ADJUST_HOLDS = `
local holds = tonumber(redis.call('hget', KEYS[1], ARGV[1]) or '0')
if holds < 1 then return -1 end
local want = tonumber(ARGV[3]) + tonumber(ARGV[2])
if holds == want then return holds end
if holds ~= tonumber(ARGV[3]) or want < 1 then return -2 end
return redis.call('hincrby', KEYS[1], ARGV[1], ARGV[2])
`;

/**
 * A script over many locks (KEYS): for each lock whose holder's hash field (Lua expression `field`
 * of `i`) is there, runs `body` with locals `lock` and `lease` (the ARGV string `lease` names).
 * Returns one integer per key: 1 done, 0 no longer held by that owner (gone or taken).
 */
function eachHeldLock(field: string, lease: string, body: string): string {
  return `
local out = {}
for i = 1, #KEYS do
  local lock, lease = KEYS[i], ${lease}
  if redis.call('hexists', lock, ${field}) == 1 then
    ${body}
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
`;
}

/**
 * Renew many locks in one call, each only if its owner still holds it (the watchdog).
 * KEYS[i] lock hash i. ARGV[2i-1] the hash field of lock i's holder (the owner, or owner:read for a read hold), ARGV[2i] its lease in ms.
 * A lock has one lease, and each of its holders (other readers, the owner's other side, the same
 * owner in another process) counts on it as it was last set: a renewal only lengthens it.
 * Returns one integer per key: 1 renewed, 0 no longer held by that owner (gone or taken).
 */
export const RENEW = eachHeldLock(
  'ARGV[2 * i - 1]',
  'ARGV[2 * i]',
  // The lease goes to PEXPIRE as the string it came in as: Lua formats a number with sprintf.
  `if redis.call('pttl', lock) < tonumber(lease) then redis.call('pexpire', lock, lease) end`,
);

/**
 * Set the lease of locks (extend(), and minHoldMs's last release), each only if its owner still
 * holds it: as RENEW, but a holder alone (the hash's other fields, `:mode` and `:handed`, hold
 * nothing) that counts no more holds than the caller says are its own also sets it shorter (an
 * owner given by name may hold the lock in another process too, which counts on the lease). A
 * lease set shorter is announced `all` on the lock's channel: waiters sleep until the lease they
 * last saw ends, and each tries again now, so it learns the new one.
 * KEYS[i] lock hash i. ARGV[1] publish command; ARGV[4i-2] the holder's hash field, ARGV[4i-1] its
 * lease in ms, ARGV[4i] the lock's release channel, ARGV[4i+1] the most holds the holder may count
 * for a shorter lease (-1: no limit).
 * Returns one integer per key, as RENEW.
 */
export const SET_LEASE = eachHeldLock(
  'ARGV[4 * i - 2]',
  'ARGV[4 * i - 1]',
  `local ttl, ms, most = redis.call('pttl', lock), tonumber(lease), tonumber(ARGV[4 * i + 1])
    if ttl < ms then
      redis.call('pexpire', lock, lease)
    elseif ttl > ms and redis.call('hlen', lock) - redis.call('hexists', lock, ':mode') - redis.call('hexists', lock, ':handed') == 1
      and (most < 0 or tonumber(redis.call('hget', lock, ARGV[4 * i - 2])) <= most) then
      redis.call('pexpire', lock, lease)
      redis.pcall(ARGV[1], ARGV[4 * i], 'all')
    end`,
);

/**
 * Read a lock's state.
 * KEYS[1] lock hash. ARGV[1] the holder's hash field ('' for none).
 * Returns {exists 1/0, the owner's holds, remaining lease in ms (-1 no expiry, -2 no key)}.
 */
export const INSPECT = `
local ttl = redis.call('pttl', KEYS[1])
if ttl == -2 then return {0, 0, -2} end
local holds = 0
if ARGV[1] ~= '' then holds = tonumber(redis.call('hget', KEYS[1], ARGV[1]) or '0') end
return {1, holds, ttl}
`;

/**
 * The hash fields of a lock (its holders), for FORCE_UNLOCK's look. A script rather than HKEYS: a
 * Cluster client with ioredis's `scaleReads` would send a read command to a replica, which may not
 * have the lock yet.
 */
export const HOLDERS = `return redis.call('hkeys', KEYS[1])`;

/**
 * Delete a lock whoever holds it, and hand it to the next fair waiter, or announce \`all\`: every
 * waiter retries, as readers waiting on a write lock must (its hash does not tell it from an
 * exclusive lock, whose waiters race once and go back to sleep).
 * KEYS and ARGV as RELEASE; ARGV[1] unused; ARGV[5] \`1\` to delete only the lock that the hash
 * fields ARGV[6..] describe (its holders when the caller looked), \`0\` to delete it whatever its
 * fields. A connection that drops before the reply makes ioredis send the script again: the fields
 * keep that second run from deleting a lock another owner took in between.
 * Returns 1 when a lock was deleted, 0 when there was none, -1 when its fields differ from ARGV[6..].
 */
export const FORCE_UNLOCK = `
${freedKeys}
if ARGV[5] == '1' then
  local fields = redis.call('hkeys', lock)
  if #fields == 0 then return 0 end
  if #fields ~= #ARGV - 5 then return -1 end
  local seen = {}
  for i = 6, #ARGV do seen[ARGV[i]] = true end
  for _, field in ipairs(fields) do
    if not seen[field] then return -1 end
  end
end
if redis.call('del', lock) == 0 then return 0 end
${freed('ARGV[4]', 'all')}
return 1
`;

/** Lua fragment: drop writers' places that lapsed; `live` = how many writers still wait. */
const liveWriters = `local t = redis.call('time')
local nowMs = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('zremrangebyscore', writers, '-inf', nowMs)
local live = redis.call('zcard', writers)`;

/**
 * Take a read lock.
 * KEYS[1] lock hash, KEYS[2] fencing counter, KEYS[3] waiting writers.
 * ARGV[1] owner, ARGV[2] lease in ms, ARGV[3] counter lifetime in ms.
 * Returns {1, read holds, fencing token} or {0, ms to sleep at most}.
 */
export const ACQUIRE_READ = `
local lock, fence, writers = KEYS[1], KEYS[2], KEYS[3]
local owner, lease = ARGV[1], tonumber(ARGV[2])
local field = owner .. ':read'
${reenterAs('field')}
local exists = redis.call('exists', lock) == 1
local mode = redis.call('hget', lock, ':mode')
-- A writer (or exclusive holder) may read its own lock: downgrade.
local downgrade = exists and mode ~= 'read' and redis.call('hexists', lock, owner) == 1
if exists and mode ~= 'read' and not downgrade then return {0, redis.call('pttl', lock)} end
${liveWriters}
if live > 0 and not downgrade then
  if exists then return {0, redis.call('pttl', lock)} end
  local first = redis.call('zrange', writers, 0, 0, 'withscores')
  return {0, math.max(1, tonumber(first[2]) - nowMs)}
end
${nextToken('t')}
if not exists then redis.call('hset', lock, ':mode', 'read') end
redis.call('hset', lock, field, '1')
local ttl = redis.call('pttl', lock)
if ttl < lease then redis.call('pexpire', lock, ARGV[2]) end
return {1, 1, tonumber(token)}
`;

/**
 * Take a write lock (read-write mode).
 * KEYS[1] lock hash, KEYS[2] fencing counter, KEYS[3] waiting writers.
 * ARGV[1] owner, ARGV[2] lease in ms, ARGV[3] counter lifetime in ms, ARGV[4] writer place timeout in ms.
 * Returns {1, write holds, token}, {0, ms to sleep at most} (the writer now waits in KEYS[3]), or
 * {-1} when the owner holds only a read lock (an upgrade, refused).
 */
export const ACQUIRE_WRITE = `
local lock, fence, writers = KEYS[1], KEYS[2], KEYS[3]
local owner, lease = ARGV[1], tonumber(ARGV[2])
if redis.call('exists', lock) == 0 then
  redis.call('zrem', writers, owner)
  ${grantFresh("redis.call('time')")}
end
${reenter}
if redis.call('hexists', lock, owner .. ':read') == 1 then return {-1} end
${liveWriters}
redis.call('zadd', writers, nowMs + tonumber(ARGV[4]), owner)
${lengthen('writers', '2 * tonumber(ARGV[4])')}
return {0, redis.call('pttl', lock)}
`;

/**
 * Lua fragment: the hash field \`field\` of a read-write lock (KEYS[1], local \`lock\`) has just
 * been deleted. A lock left with nothing but its \`:mode\` is deleted; a writer that leaves only its
 * own read holds makes it a read lock. Either change lets others in and announces \`all\` (ARGV[3]
 * on channel ARGV[2]), so every waiter retries and readers go in together.
 */
const rwFieldGone = `local left = redis.call('hlen', lock)
local mode = redis.call('hget', lock, ':mode')
if left == 0 or (left == 1 and mode) then
  redis.call('del', lock)
  redis.pcall(ARGV[3], ARGV[2], 'all')
elseif not mode and string.sub(field, -5) ~= ':read' then
  -- the writer left; only its own read holds remain
  redis.call('hset', lock, ':mode', 'read')
  redis.pcall(ARGV[3], ARGV[2], 'all')
end`;

/**
 * Drop one hold in read-write mode.
 * KEYS[1] lock hash. ARGV[1] hash field (owner for a write hold, owner:read for a read hold), ARGV[2] channel, ARGV[3] publish command,
 * ARGV[4] `1` when the caller still holds that side after this release (see keepLastHold).
 * Returns the holds of that field left (0: dropped), or -1 when it held nothing.
 * When the last write hold goes and read holds remain (a downgrade), the lock becomes a read lock.
 * Every change that lets others in announces `all`.
 */
export const RELEASE_RW = `
local lock, field = KEYS[1], ARGV[1]
local holds = redis.call('hget', lock, field)
if not holds then return -1 end
if tonumber(holds) > 1 then return redis.call('hincrby', lock, field, -1) end
${keepLastHold('ARGV[4]')}redis.call('hdel', lock, field)
${rwFieldGone}
return 0
`;

/**
 * Drop every hold of one holder field of a read-write lock (after a loss, at shutdown): as
 * RELEASE_RW's last hold, announcing `all` as it does.
 * KEYS[1] lock hash. ARGV[1] hash field (owner for the write side, owner:read for the read side), ARGV[2] channel, ARGV[3] publish command.
 * Returns 1 when the field held the lock, else 0.
 */
export const RELEASE_ALL_RW = `
local lock, field = KEYS[1], ARGV[1]
if redis.call('hdel', lock, field) == 0 then return 0 end
${rwFieldGone}
return 1
`;

/**
 * Leave the waiting writers (a writer gave up, or a Redlock writer leaves a node that refused it).
 * KEYS[1] waiting writers, KEYS[2] lock hash. ARGV[1] owner, ARGV[2] channel, ARGV[3] publish command.
 * Readers that the place kept out sleep until it or the read lock's lease would end: when the
 * place was there and the lock is free or a read lock, announces `all`, so they try again now.
 * Returns 1 when the owner had a place, else 0.
 */
export const LEAVE_WRITERS = `
if redis.call('zrem', KEYS[1], ARGV[1]) == 0 then return 0 end
if redis.call('hget', KEYS[2], ':mode') == 'read' or redis.call('exists', KEYS[2]) == 0 then
  redis.pcall(ARGV[3], ARGV[2], 'all')
end
return 1
`;

/**
 * Take several exclusive locks at once, all or nothing (one atomic step on one server).
 * KEYS[2i-1] lock hash i, KEYS[2i] its fencing counter. ARGV[1] owner, ARGV[2] lease in ms, ARGV[3] counter lifetime in ms.
 * Returns {1, holdCount1, token1, holdCount2, token2, ...} when all were taken (free ones fresh,
 * the owner's own ones re-entered), or {0, i, remaining lease of lock i} for the first lock i held
 * by another owner, having changed nothing.
 */
export const ACQUIRE_MANY = `
local owner, lease = ARGV[1], tonumber(ARGV[2])
local n = #KEYS / 2
for i = 1, n do
  local lock = KEYS[2 * i - 1]
  if redis.call('exists', lock) == 1 and redis.call('hexists', lock, owner) == 0 then
    return {0, i, redis.call('pttl', lock)}
  end
end
local t = ARGV[3] ~= '0' and redis.call('time')
local out = {1}
for i = 1, n do
  local lock, fence = KEYS[2 * i - 1], KEYS[2 * i]
  if redis.call('exists', lock) == 0 then
    ${nextToken('t')}
    redis.call('hset', lock, owner, '1')
    redis.call('pexpire', lock, ARGV[2])
    out[#out + 1] = 1
    out[#out + 1] = tonumber(token)
  else
    local holds = redis.call('hincrby', lock, owner, '1')
    ${lengthenLease}
    out[#out + 1] = holds
    out[#out + 1] = ${currentToken}
  end
end
return out
`;

/**
 * Publish on a lock's channel as the release scripts do (KEYS[1] the lock hash, for Cluster
 * routing; ARGV[1] the publish command, ARGV[2] the channel), to tell at bootstrap whether this
 * connection's user may (see the note on `redis.pcall` above). Nobody waits on the channel used.
 */
export const PUBLISH_CHECK = `return redis.call(ARGV[1], ARGV[2], 'check')`;

/**
 * Which commands the lock scripts call this connection's user may not run on a lock's names
 * (KEYS[1] a lock hash; its fence, queue and queue timeouts are named after it, as the scripts
 * name them), each asked with arguments of its shape through `redis.acl_check_cmd` (Redis 7 and
 * later; an older Redis answers an empty list). Runs nothing. PUBLISH is PUBLISH_CHECK's.
 */
export const ACL_CHECK = `if not redis.acl_check_cmd then return {} end
local lock = KEYS[1]
local fence, queue = lock .. ':fence', lock .. ':queue'
local timeouts = queue .. ':timeouts'
local calls = {
  {'exists', lock}, {'del', lock}, {'pexpire', lock, '1'}, {'pttl', lock}, {'time'},
  {'hget', lock, 'f'}, {'hset', lock, 'f', 'v'}, {'hdel', lock, 'f'}, {'hexists', lock, 'f'},
  {'hincrby', lock, 'f', '1'}, {'hkeys', lock}, {'hlen', lock},
  {'get', fence}, {'set', fence, 'v'},
  {'rpush', queue, 'v'}, {'lpop', queue}, {'lindex', queue, '0'}, {'lrem', queue, '0', 'v'},
  {'zadd', timeouts, '0', 'm'}, {'zrem', timeouts, 'm'}, {'zcard', timeouts}, {'zrange', timeouts, '0', '-1'},
  {'zrangebyscore', timeouts, '0', '1'}, {'zremrangebyscore', timeouts, '0', '1'},
}
local refused = {}
for _, call in ipairs(calls) do
  if not redis.acl_check_cmd(unpack(call)) then refused[#refused + 1] = call[1] end
end
return refused`;
