import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import type { Redis } from 'ioredis';
import { LockBackendError, LockLostError } from '../../lib/index.js';
import { aborted, bootstrapFailure, startLockApp, type LockApp } from '../support/lock-testing.js';
import { commandCalls, RedisServer } from '../support/redis-server.js';

/** Writes 10 kB strings without expiry until Redis refuses one for memory; returns the error. */
async function fill(raw: Redis): Promise<unknown> {
  for (let i = 0; ; i++) {
    const error = await raw.set(`fill:${i}`, 'x'.repeat(10_000)).then(() => undefined, (e: unknown) => e);
    if (error) return error;
  }
}

const evictionWarning = /may evict lock keys: maxmemory is 3145728 bytes with maxmemory-policy volatile-lru\..*Set maxmemory-policy noeviction/;

describe('a Redis that may evict lock keys (maxmemory with volatile-lru, the default of several managed services)', () => {
  let redis: RedisServer;
  let raw: Redis;
  let app: LockApp;
  let other: LockApp;
  beforeAll(async () => {
    redis = await RedisServer.start(['--maxmemory', '3mb', '--maxmemory-policy', 'volatile-lru']);
    raw = redis.client();
    app = await startLockApp({ redis: redis.url, leaseMs: 1_000 });
    other = await startLockApp({ redis: redis.url, connectTimeoutMs: 0 });
  });
  afterAll(async () => {
    await app?.close();
    await other?.close();
    await redis?.stop();
  });

  it('warns at bootstrap, naming maxmemory, the policy and what to set', () => {
    expect(app.logger.at('warn')).toEqual([expect.stringMatching(evictionWarning)]);
    // connectTimeoutMs: 0 skips the bootstrap check, and its warning with it.
    expect(other.logger.at('warn')).toEqual([]);
  });

  it('is right to: under memory pressure Redis deletes a held lock, another owner takes it, and the holder is told at its next renewal', async () => {
    const held = await app.locks.acquire('evicted');
    const lost = aborted(held.signal);
    // Only keys with an expiry can go under volatile-lru, and the fill keys have none: the lock's do.
    expect(String(await fill(raw))).toMatch(/OOM command not allowed/);
    expect(await raw.exists('lock:{evicted}')).toBe(0);
    // SYNC: Valkey 8 frees a plain FLUSHALL's memory in a background thread (lazyfree-lazy-user-flush
    // defaults to yes there), and until it has, Redis is still over maxmemory and refuses the next write.
    await raw.flushall('SYNC');
    const taken = await other.locks.tryAcquire('evicted');
    expect(taken).not.toBeNull();
    const reason = await lost;
    expect(reason).toBeInstanceOf(LockLostError);
    expect((reason as LockLostError).reason).toBe('taken');
    await taken!.release();
  });
});

describe('a Redis with maxmemory and noeviction', () => {
  let redis: RedisServer;
  beforeAll(async () => {
    redis = await RedisServer.start(['--maxmemory', '3mb', '--maxmemory-policy', 'noeviction']);
  });
  afterAll(async () => {
    await redis?.stop();
  });

  it('gives no warning; once full it refuses acquisitions with LockBackendError (OOM), and releases still work', async () => {
    const app = await startLockApp({ redis: redis.url });
    const raw = redis.client();
    try {
      expect(app.logger.at('warn')).toEqual([]);
      const held = await app.locks.acquire('before');
      // Full, and staying full: a limit far below what Redis uses. (Filling up to the limit leaves
      // Redis at its edge, where a trimmed buffer can let the next write in.)
      await raw.config('SET', 'maxmemory', '1');
      const before = await commandCalls(raw, 'evalsha', 'eval');
      const refused = await app.locks.tryAcquire('after').catch((e: unknown) => e);
      expect(refused).toBeInstanceOf(LockBackendError);
      expect((refused as Error).message).toMatch(/OOM command not allowed/);
      // Sent once, by SHA: only NOSCRIPT sends a script's text again (EVAL), not any error reply.
      const after = await commandCalls(raw, 'evalsha', 'eval');
      expect(after.evalsha).toBeGreaterThan(before.evalsha);
      expect(after.eval).toBe(before.eval);
      await held.release();
      expect(await raw.exists('lock:{before}')).toBe(0);
    } finally {
      await raw.config('SET', 'maxmemory', '3mb');
      await app.close();
    }
  });
});

describe('a Redis with an eviction policy but no maxmemory', () => {
  it('gives no warning: without a limit, Redis evicts nothing', async () => {
    const redis = await RedisServer.start(['--maxmemory-policy', 'allkeys-lru']);
    try {
      expect(await redis.client().config('GET', 'maxmemory')).toEqual(['maxmemory', '0']);
      const app = await startLockApp({ redis: redis.url });
      await app.close();
      expect(app.logger.at('warn')).toEqual([]);
    } finally {
      await redis.stop();
    }
  });
});

describe('a Redis user that may not run INFO (an ACL)', () => {
  it('starts without the version and eviction checks, says so at debug, and takes locks', async () => {
    // A Redis that would be warned of: maxmemory with volatile-lru.
    const redis = await RedisServer.start(['--maxmemory', '3mb', '--maxmemory-policy', 'volatile-lru']);
    try {
      await redis.client().call('ACL', 'SETUSER', 'noinfo', 'on', '>noinfo-password', '~*', '&*', '+@all', '-info');
      const app = await startLockApp({ redis: `redis://noinfo:noinfo-password@127.0.0.1:${redis.port}` });
      try {
        expect(app.logger.at('warn')).toEqual([]);
        expect(app.logger.at('debug')).toEqual(
          expect.arrayContaining([
            expect.stringMatching(/^could not read INFO server of redis 127\.0\.0\.1:\d+: .*NOPERM/),
            expect.stringMatching(/^could not read INFO memory of redis 127\.0\.0\.1:\d+: .*NOPERM/),
            expect.stringMatching(/^could not read INFO replication of redis 127\.0\.0\.1:\d+: .*NOPERM/),
          ]),
        );
        expect(await app.locks.run('no-info', async (lock) => lock.holdCount)).toBe(1);
      } finally {
        await app.close();
      }
    } finally {
      await redis.stop();
    }
  });
});

describe('a Redis without INFO (rename-command INFO "")', () => {
  let redis: RedisServer;
  beforeAll(async () => {
    redis = await RedisServer.start(['--rename-command', 'INFO', '']);
  });
  afterAll(async () => {
    await redis?.stop();
  });

  it("fails bootstrap naming ioredis's ready check, which sends INFO, and the option that turns it off", async () => {
    const failure = await bootstrapFailure(() => startLockApp({ redis: redis.url, connectTimeoutMs: 1_000 }));
    expect(failure).toBeInstanceOf(LockBackendError);
    expect((failure as Error).message).toMatch(
      /no answer from redis 127\.0\.0\.1:\d+ within 1000 ms; the connection failed with: ERR unknown command 'info'.*\. ioredis checks that a connection is ready with INFO, which this Redis does not have \(renamed or disabled\): give ioredis options with enableReadyCheck: false/,
    );
  });

  it('starts with enableReadyCheck: false, without the checks that read INFO, and takes locks', async () => {
    const app = await startLockApp({ redis: { host: '127.0.0.1', port: redis.port, enableReadyCheck: false } });
    try {
      expect(app.logger.at('debug')).toEqual(expect.arrayContaining([expect.stringMatching(/^could not read INFO server of redis 127\.0\.0\.1:\d+: .*unknown command/)]));
      expect(await app.locks.run('no-info-command', async (lock) => lock.holdCount)).toBe(1);
    } finally {
      await app.close();
    }
  });
});
