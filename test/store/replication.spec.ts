import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Redis } from 'ioredis';
import { LockBackendError, LockReplicationError, type LockHandle } from '../../lib/index.js';
import { RedisServer, commandCalls, replicaAcknowledges, tcpProxy, until } from '../support/redis-server.js';
import { asleep, elsewhere, nextEvent, startLockApp, waitRegistered, within } from '../support/lock-testing.js';

/**
 * Replica confirmation (`replication`: Redis WAIT after acquire, renew and release) on real servers:
 * a master with a replica, a master without one, and a server that refuses WAIT (renamed away, as
 * some managed services do).
 */
describe('replica confirmation (WAIT)', () => {
  let master: RedisServer;
  let replica: RedisServer;
  let lonely: RedisServer;
  let refusing: RedisServer;
  /** Synced is not enough: ready once the replica acknowledges a write. */
  const replicaCaughtUp = async () => {
    const probe = master.client();
    await until(() => replicaAcknowledges(probe), 10_000, 'the replica never acknowledged a write');
  };

  beforeAll(async () => {
    master = await RedisServer.start();
    replica = await RedisServer.start(['--replicaof', '127.0.0.1', String(master.port)]);
    lonely = await RedisServer.start();
    refusing = await RedisServer.start(['--rename-command', 'WAIT', '']);
    await replicaCaughtUp();
  });
  afterAll(async () => {
    await Promise.all([master, replica, lonely, refusing].map((s) => s?.stop()));
  });

  it('returns from acquire and release only once the replica has them', async () => {
    const app = await startLockApp({ redis: master.url, replication: { replicas: 1, timeoutMs: 2_000 } });
    try {
      const lock = await app.locks.acquire('r:confirmed');
      expect(await replica.client().hget('lock:{r:confirmed}', lock.owner)).toBe('1');
      await lock.release();
      expect(await replica.client().exists('lock:{r:confirmed}')).toBe(0);
    } finally {
      await app.close();
    }
  });

  it('works on an ioredis client passed in (not taken for a Cluster client, which has no WAIT to follow a lock)', async () => {
    const client = master.client();
    const app = await startLockApp({ redis: client, replication: { replicas: 1, timeoutMs: 2_000 } });
    try {
      const waits = async () => (await commandCalls(master.client(), 'wait')).wait;
      const before = await waits();
      const lock = await app.locks.acquire('r:passed');
      expect(await replica.client().hget('lock:{r:passed}', lock.owner)).toBe('1');
      await lock.release();
      expect(await replica.client().exists('lock:{r:passed}')).toBe(0);
      expect((await waits()) - before).toBe(2);
    } finally {
      await app.close();
    }
  });

  it('confirms a fair handover like any grant: the waiter takes it over with its own attempt and waits for the replica', async () => {
    const app = await startLockApp({ redis: master.url, replication: { replicas: 1, timeoutMs: 2_000 } });
    try {
      const holder = await app.locks.acquire('r:fair', { fair: true });
      const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === 'r:fair');
      const waiting = app.locks.acquire('r:fair', { fair: true });
      const { owner } = await contended;
      // Release once the waiter sleeps with its wait registered, so a handover message could reach it.
      await waitRegistered(master.client(), 'r:fair', owner);
      await holder.release();
      const lock = await waiting;
      // Its own attempt took the handover over (that clears the `:handed` mark), then WAIT.
      expect(await master.client().hexists('lock:{r:fair}', ':handed')).toBe(0);
      expect(await replica.client().hget('lock:{r:fair}', lock.owner)).toBe('1');
      await lock.release();
    } finally {
      await app.close();
    }
  });

  it("confirms the grant of a waiter a release takes along: it is not handed the lock inside the release, its own attempt waits for the replicas", async () => {
    const app = await startLockApp({ redis: master.url, replication: { replicas: 1, timeoutMs: 50 } });
    try {
      const holder = await app.locks.acquire('r:along');
      const waiting = elsewhere(() => app.locks.acquire('r:along', { waitMs: 10_000 })).catch((e: unknown) => e);
      await until(async () => asleep(app, 'r:along') === 1, 10_000, 'the waiter asleep');
      replica.pause();
      try {
        await holder.release();
        // Handed over inside the release, the waiter would hold a lock no replica acknowledged.
        const failure = (await waiting) as LockReplicationError;
        expect(failure).toBeInstanceOf(LockReplicationError);
        expect(await master.client().exists('lock:{r:along}')).toBe(0);
      } finally {
        replica.resume();
        await replicaCaughtUp(); // for the tests after this one
      }
    } finally {
      await app.close();
    }
  });

  it('rolls back a multi-key acquisition no replica acknowledged: none of its keys stays held', async () => {
    const app = await startLockApp({ redis: lonely.url, replication: { replicas: 1, timeoutMs: 50 } });
    try {
      const failure = (await app.locks.acquire(['r:group:a', 'r:group:b']).catch((e: unknown) => e)) as LockReplicationError;
      expect(failure).toBeInstanceOf(LockReplicationError);
      expect(failure.message).toContain('only 0 of 1 required replica(s) acknowledged it within 50 ms; it was given back');
      expect(await lonely.client().exists('lock:{r:group:a}', 'lock:{r:group:b}')).toBe(0);
    } finally {
      await app.close();
    }
  });

  it('keeps an unconfirmed re-entry: it changes no ownership, so only a fresh grant is given back', async () => {
    // The first hold is kept unconfirmed ('keep'); the same owner token re-enters through a service
    // that rolls back: its grant is a second hold, which no replica's answer decides.
    const keeping = await startLockApp({ redis: lonely.url, replication: { replicas: 1, timeoutMs: 50, onUnconfirmedAcquire: 'keep' } });
    const rollingBack = await startLockApp({ redis: lonely.url, replication: { replicas: 1, timeoutMs: 50 } });
    try {
      const outer = await keeping.locks.acquire('r:reentered', { owner: 'job-r' });
      const inner = await rollingBack.locks.acquire('r:reentered', { owner: 'job-r' });
      expect(inner.holdCount).toBe(2);
      expect(await lonely.client().hget('lock:{r:reentered}', 'job-r')).toBe('2');
      await inner.release();
      await outer.release();
      expect(await lonely.client().exists('lock:{r:reentered}')).toBe(0);
    } finally {
      await rollingBack.close();
      await keeping.close();
    }
  });

  it('rolls back an acquisition no replica acknowledged and says so with a typed error', async () => {
    const app = await startLockApp({ redis: lonely.url, replication: { replicas: 1, timeoutMs: 50 } });
    try {
      const failure = (await app.locks.acquire('r:unconfirmed').catch((e: unknown) => e)) as LockReplicationError;
      expect(failure).toBeInstanceOf(LockReplicationError);
      expect(String(failure)).toMatch(/^LockReplicationError: Lock "r:unconfirmed" was granted by the Redis master, but only 0 of 1 required replica\(s\) acknowledged it within 50 ms; it was given back\. Check the replicas/);
      expect(failure.acknowledged).toBe(0);
      expect(await lonely.client().exists('lock:{r:unconfirmed}')).toBe(0);
      // The give-back waited for the replicas too (a release), and noted that none acknowledged it.
      expect(app.logger.at('debug')).toContainEqual('release of "r:unconfirmed": 0 of 1 replica(s) acknowledged within 50 ms');
    } finally {
      await app.close();
    }
  });

  it("keeps an unconfirmed acquisition with onUnconfirmedAcquire: 'keep', with a warning", async () => {
    const app = await startLockApp({ redis: lonely.url, replication: { replicas: 1, timeoutMs: 50, onUnconfirmedAcquire: 'keep' } });
    try {
      // A 600 ms lease renewed by the watchdog every 200 ms.
      const lock = await app.locks.acquire('r:kept', { leaseMs: 600, watchdog: true });
      expect(await lonely.client().hget('lock:{r:kept}', lock.owner)).toBe('1');
      expect(app.logger.at('warn').filter((m) => m.includes('r:kept') && m.includes('0 of 1 replica(s)'))).toHaveLength(1);
      // A renewal waits for the replicas too; a shortfall is noted at debug, and the renewal stands.
      await nextEvent(app.locks.events$, 'renewed', (e) => e.key === 'r:kept');
      expect(app.logger.at('debug')).toContainEqual('renewal of 1 lock(s): 0 of 1 replica(s) acknowledged within 50 ms');
      expect(lock.isHeld).toBe(true);
      await lock.release();
      expect(app.logger.at('debug')).toContainEqual('release of "r:kept": 0 of 1 replica(s) acknowledged within 50 ms');
    } finally {
      await app.close();
    }
  });

  it('waits for a replication timeout longer than the 1 s attempt bound: tryAcquire() and a release see the outcome of WAIT, not "no answer"', async () => {
    for (const onUnconfirmedAcquire of ['rollback', 'keep'] as const) {
      const app = await startLockApp({ redis: lonely.url, replication: { replicas: 1, timeoutMs: 1_500, onUnconfirmedAcquire } });
      try {
        const key = `r:long-wait:${onUnconfirmedAcquire}`;
        const outcome = await app.locks.tryAcquire(key).catch((error: unknown) => error);
        if (onUnconfirmedAcquire === 'rollback') {
          expect(outcome).toBeInstanceOf(LockReplicationError);
          expect(await lonely.client().exists(`lock:{${key}}`)).toBe(0);
        } else {
          const lock = outcome as LockHandle;
          expect(await lonely.client().hget(`lock:{${key}}`, lock.owner)).toBe('1');
          // Its release waits for WAIT's 1.5 s too, and is not reported failed.
          const failed: unknown[] = [];
          const watching = app.locks.events$.subscribe((e) => void (e.type === 'release-failed' && failed.push(e)));
          await lock.release();
          watching.unsubscribe();
          expect(failed).toEqual([]);
          expect(await lonely.client().exists(`lock:{${key}}`)).toBe(0);
        }
      } finally {
        await app.close();
      }
    }
  });

  it('lets steps whose replies arrive together share one WAIT, so a replica that does not answer costs queued steps one more WAIT, not one each', async () => {
    // No replica: every WAIT runs its whole timeout, and blocks the lock connection meanwhile.
    const probe = lonely.client();
    const waits = async () => (await commandCalls(probe, 'wait')).wait;
    const blockedInWait = async () => String(await probe.client('LIST')).split('\n').filter((line) => / cmd=wait /.test(line)).length;
    const app = await startLockApp({ redis: lonely.url, replication: { replicas: 1, timeoutMs: 2_000, onUnconfirmedAcquire: 'keep' } });
    try {
      const before = await waits();
      const first = app.locks.acquire('r:shared:0');
      await until(async () => (await blockedInWait()) === 1, 1_800, 'the first acquisition never waited for replicas');
      // Sent while that WAIT blocks the connection: Redis runs all 16 scripts when it returns and
      // answers them together.
      const queued = Array.from({ length: 16 }, (_, i) => app.locks.acquire(`r:shared:${i + 1}`));
      const locks = await Promise.all([first, ...queued]);
      // The first WAIT and one shared by the 16 (a third only if their replies were split across
      // two reads); one WAIT per step would make it 17.
      expect((await waits()) - before).toBeLessThanOrEqual(3);
      expect(locks.map((l) => l.holdCount)).toEqual(new Array(17).fill(1));
      for (const lock of locks) expect(await lonely.client().hget(`lock:{${lock.key}}`, lock.owner)).toBe('1');
      await Promise.all(locks.map((l) => l.release()));
      expect(await lonely.client().keys('lock:{r:shared:*}')).toEqual([]);
    } finally {
      await app.close();
    }
  });

  it('lets steps whose replies come one read at a time while a WAIT is unanswered share the next one: each waits for at most two, within its bound', async () => {
    // Replies split across reads (a loaded machine, a slow link): a proxy keeps the replies of six
    // releases, then sends them one line at a time, 10 ms apart. The first sends a WAIT; the other
    // five come while it blocks (1 s, no replica) and share the one sent when it returns. One WAIT
    // each would queue six on the connection: the last release would wait 6 s, past its bound
    // (stepTimeoutMs + 2 x timeoutMs = 3 s), and fail.
    const proxy = await tcpProxy(lonely.port);
    const probe = lonely.client();
    const waits = async () => (await commandCalls(probe, 'wait')).wait;
    const app = await startLockApp({
      redis: `redis://127.0.0.1:${proxy.port}`,
      replication: { replicas: 1, timeoutMs: 1_000, onUnconfirmedAcquire: 'keep' },
    });
    const failed: unknown[] = [];
    const watching = app.locks.events$.subscribe((e) => void (e.type === 'release-failed' && failed.push(e)));
    try {
      const locks = await Promise.all(Array.from({ length: 6 }, (_, i) => app.locks.acquire(`r:apart:${i}`)));
      const before = await waits();
      proxy.delayRepliesFrom('evalsha');
      const releases = Promise.all(locks.map((l) => l.release()));
      await until(async () => proxy.delayedLines >= 6, 2_000, 'the six releases never got their replies');
      proxy.passDelayed(10);
      await releases;
      expect(failed).toEqual([]);
      expect((await waits()) - before).toBe(2);
      expect(await lonely.client().keys('lock:{r:apart:*}')).toEqual([]);
    } finally {
      watching.unsubscribe();
      await app.close();
      await proxy.close();
    }
  });

  it('keeps replica confirmation on after a WAIT that fails for another reason than a refusal (its connection ended)', async () => {
    // No replica: the WAIT blocks for its 5 s. The connection ends meanwhile, for good (no retries).
    const client = new Redis(lonely.port, '127.0.0.1', { retryStrategy: () => null });
    client.on('error', () => undefined);
    const app = await startLockApp({ redis: client, replication: { replicas: 1, timeoutMs: 5_000 } });
    try {
      const raw = lonely.client();
      const failure = app.locks.acquire('r:wait-ended', { waitMs: 0 }).then(
        async (lock) => {
          await lock.release().catch(() => undefined);
          return new Error('acquired without confirmation');
        },
        (e: unknown) => e,
      );
      // Granted in Redis, and the WAIT behind it blocked: then the connection is cut.
      await until(async () => (await raw.exists('lock:{r:wait-ended}')) === 1 && (await raw.call('CLIENT', 'LIST', 'TYPE', 'normal') as string).includes('cmd=wait'), 5_000, 'the WAIT never blocked');
      await raw.call('CLIENT', 'KILL', 'TYPE', 'normal', 'SKIPME', 'yes');
      expect(await within(failure, 3_000)).toBeInstanceOf(LockBackendError);
      expect(app.logger.at('warn').filter((m) => m.includes('refused WAIT'))).toEqual([]);
    } finally {
      await app.close();
      client.disconnect();
    }
  });

  it('detects a server that refuses WAIT once, warns once, and locks without it', async () => {
    const app = await startLockApp({ redis: refusing.url, replication: { replicas: 1, timeoutMs: 50 } });
    try {
      for (let i = 0; i < 3; i++) {
        const lock = await app.locks.acquire('r:refused');
        expect(await refusing.client().hget('lock:{r:refused}', lock.owner)).toBe('1');
        await lock.release();
      }
      const warnings = app.logger.at('warn').filter((m) => m.includes('refused WAIT'));
      expect(warnings).toHaveLength(1);
      expect(warnings[0]).toContain('replica confirmation is off from now on');
    } finally {
      await app.close();
    }
  });
});
