// nestjs-locked's acquire and release scripts sent from a bare ioredis client, with the keys and
// arguments RedisLockStore gives them (default prefix, no fair queue), for the profiling tools.
import type { Redis } from 'ioredis';
import { FENCE_COUNTER_TTL_MS } from '../lib/store/redis/lock.scripts.js';

/** Loads an acquire and a release script; resolves to one acquire + release pair of `key` for `owner`. */
export async function scriptsPair(client: Redis, acquire: string, release: string): Promise<(key: string, owner: string) => Promise<void>> {
  const [a, r] = (await Promise.all([client.script('LOAD', acquire), client.script('LOAD', release)])) as string[];
  return async (key, owner) => {
    const name = `lock:{${key}}`;
    await client.evalsha(a!, 2, name, `${name}:fence`, owner, 30_000, FENCE_COUNTER_TTL_MS);
    await client.evalsha(r!, 2, name, `${name}:queue`, owner, name, 'publish');
  };
}
