import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import type { Redis } from 'ioredis';
import { Fixture } from '../support/children.js';
import type { LockModuleOptions } from '../../lib/index.js';
import { RedisCluster } from '../support/redis-cluster.js';
import { RedisServer } from '../support/redis-server.js';

const PROCESSES = 4;
const WORKERS = 4;
const ITERATIONS = 63; // 4 x 4 x 63 = 1008 increments

/**
 * Runs the counter fixture in PROCESSES processes at once and returns the final counter. The
 * counter lives on `redis`; the locks where `lockOptions` say (the same server by default).
 */
async function race(redis: RedisServer, mode: 'locked' | 'unlocked', counterKey: string, lockOptions: LockModuleOptions = { redis: redis.url }): Promise<number> {
  const children = Array.from(
    { length: PROCESSES },
    () => new Fixture('counter-worker', [JSON.stringify(lockOptions), redis.url, String(WORKERS), String(ITERATIONS), mode, counterKey]),
  );
  try {
    await Promise.all(children.map((c) => c.next('ready')));
    for (const c of children) c.send({ type: 'go' });
    await Promise.all(children.map((c) => c.next('done', undefined, 120_000)));
    const exits = await Promise.all(children.map((c) => c.exited));
    expect(exits).toEqual(children.map(() => ({ code: 0, signal: null })));
  } finally {
    await Promise.all(children.map((c) => c.stop()));
  }
  return Number(await client.get(counterKey));
}

let client: Redis;

describe('mutual exclusion across processes', () => {
  let redis: RedisServer;
  beforeAll(async () => {
    redis = await RedisServer.start();
    client = redis.client();
  });
  afterAll(async () => {
    await redis?.stop();
  });

  it(`keeps a non-atomic counter exact: ${PROCESSES} processes x ${WORKERS} workers x ${ITERATIONS} increments`, async () => {
    expect(await race(redis, 'locked', 'counter:locked')).toBe(PROCESSES * WORKERS * ITERATIONS);
  });

  it('loses updates without the lock (the test above can catch a violation)', async () => {
    expect(await race(redis, 'unlocked', 'counter:unlocked')).toBeLessThan(PROCESSES * WORKERS * ITERATIONS);
  });

  it(`keeps it exact with the locks on a 3-master Redis Cluster`, async () => {
    const cluster = await RedisCluster.start();
    try {
      expect(await race(redis, 'locked', 'counter:cluster', { redis: { cluster: cluster.nodes } })).toBe(PROCESSES * WORKERS * ITERATIONS);
    } finally {
      await cluster.stop();
    }
  }, 180_000);

  it(`keeps it exact with the locks on the Redlock quorum of 3 independent servers`, async () => {
    const masters = await Promise.all([0, 1, 2].map(() => RedisServer.start()));
    try {
      expect(await race(redis, 'locked', 'counter:redlock', { redlock: { clients: masters.map((m) => m.url) } })).toBe(PROCESSES * WORKERS * ITERATIONS);
    } finally {
      await Promise.all(masters.map((m) => m.stop()));
    }
  }, 180_000);
});
