// nestjs-locked's acquire and release scripts sent from a bare ioredis client, with the keys and
// arguments RedisLockStore gives them (default prefix, no fair queue), for the profiling tools.
import type { Redis } from 'ioredis';
import { ACQUIRE, FENCE_COUNTER_TTL_MS, RELEASE } from '../lib/store/redis/lock.scripts.js';

/**
 * Loads an acquire and a release script; resolves to one acquire + release pair of `key` for
 * `owner`. `grantCounterTtlMs` is the acquire's counter lifetime: 0 as with `fencingTokens: false`.
 */
export async function scriptsPair(client: Redis, acquire: string, release: string, grantCounterTtlMs = FENCE_COUNTER_TTL_MS): Promise<(key: string, owner: string) => Promise<void>> {
  const [a, r] = (await Promise.all([client.script('LOAD', acquire), client.script('LOAD', release)])) as string[];
  return async (key, owner) => {
    const name = `lock:{${key}}`;
    await client.evalsha(a!, 2, name, `${name}:fence`, owner, 30_000, grantCounterTtlMs);
    await client.evalsha(r!, 2, name, `${name}:queue`, owner, name, 'publish', FENCE_COUNTER_TTL_MS);
  };
}

/** An acquire with a hold count and nothing else: no fencing token. */
const ACQUIRE_NO_FENCING = `local lock, owner, lease = KEYS[1], ARGV[1], tonumber(ARGV[2])
if redis.call('exists', lock) == 0 then redis.call('hset', lock, owner, '1') redis.call('pexpire', lock, ARGV[2]) return {1, 1, 0} end
return {0, redis.call('pttl', lock)}`;

/** A release of one hold and nothing else: no announcement for waiters. */
export const RELEASE_NO_ANNOUNCEMENT = `local lock, owner = KEYS[1], ARGV[1]
local holds = redis.call('hget', lock, owner)
if not holds then return -1 end
if tonumber(holds) > 1 then return redis.call('hincrby', lock, owner, -1) end
redis.call('hdel', lock, owner)
return 0`;

/**
 * Our scripts with one part taken out, to tell what each part costs (bench:instructions counts
 * redis-server's instructions, bench:profile the time): never used by the library.
 */
export const SCRIPT_VARIANTS = {
  /** The same two EVALSHA calls with bodies that do nothing: the fixed cost of running a script. */
  'scripts-empty': { label: 'breakdown: empty scripts', acquire: 'return {1, 1, 1}', release: 'return 0' },
  'scripts-no-fencing': {
    label: 'breakdown: acquire without fencing token',
    acquire: ACQUIRE_NO_FENCING,
    release: RELEASE,
  },
  'scripts-no-announcement': {
    label: 'breakdown: release without announcement',
    acquire: ACQUIRE,
    release: RELEASE_NO_ANNOUNCEMENT,
  },
  /** What a reentrant hash lock costs with neither: the floor of this data model. */
  'scripts-hold-count-only': { label: 'breakdown: hold count only (neither token nor announcement)', acquire: ACQUIRE_NO_FENCING, release: RELEASE_NO_ANNOUNCEMENT },
} as const;

export type ScriptVariant = keyof typeof SCRIPT_VARIANTS;
