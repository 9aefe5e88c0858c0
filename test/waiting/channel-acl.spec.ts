import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Redis } from 'ioredis';
import type { LockEvent, LockHandle } from '../../lib/index.js';
import { lockEachWay, nextEvent, startLockApp, waitRegistered, wokenBy, type LockApp } from '../support/lock-testing.js';
import { RedisServer, subscribers, until } from '../support/redis-server.js';

/**
 * An ACL user may publish and subscribe only on the channels it is granted, and Redis 7 creates
 * users with none (acl-pubsub-default resetchannels): a common setup on managed Redis. The release
 * scripts publish on the lock's channel after they freed it, and a Lua error does not undo writes.
 */
describe('a Redis ACL user without the lock channels', () => {
  let redis: RedisServer;
  let raw: Redis;
  const as = (user: string) => `redis://${user}:${user}-password@127.0.0.1:${redis.port}`;
  beforeAll(async () => {
    redis = await RedisServer.start();
    raw = redis.client();
    await raw.call('ACL', 'SETUSER', 'nochannels', 'on', '>nochannels-password', '~*', '+@all', 'resetchannels');
    await raw.call('ACL', 'SETUSER', 'lockchannels', 'on', '>lockchannels-password', '~*', '+@all', 'resetchannels', '&lock:*');
  });
  afterAll(async () => {
    await redis?.stop();
  });

  async function using<T>(user: string, fn: (app: LockApp) => Promise<T>, options = {}): Promise<T> {
    const app = await startLockApp({ redis: as(user), ...options });
    try {
      return await fn(app);
    } finally {
      await app.close();
    }
  }

  it('warns once at bootstrap, naming the refusal and the ACL rule that allows the channels', async () => {
    await using('nochannels', async (app) => {
      expect(app.logger.at('warn')).toEqual([
        // Redis's own refusal, in its words: Redis 7.0's, and Redis 8's and Valkey 8's.
        expect.stringMatching(
          /refused a publish on a lock channel \(.*(publish to the channel|No permissions to access a channel).*\)\. Locks still work, but a release cannot wake waiters.*ACL SETUSER <user> &lock:\*/,
        ),
      ]);
      // health() checks readiness again, not the channels.
      expect((await app.locks.health()).status).toBe('up');
      expect(app.logger.at('warn')).toHaveLength(1);
    });
  });

  it('releases and frees every kind of lock without reporting a failure: run(), release(), a write lock, forceUnlock()', async () => {
    await using('nochannels', async (app) => {
      const events: LockEvent[] = [];
      const subscription = app.locks.events$.subscribe((e) => events.push(e));
      try {
        expect(await app.locks.run('acl:run', async () => 'ran')).toBe('ran');
        const plain = await app.locks.acquire('acl:plain');
        await plain.release();
        const write = await app.locks.acquire('acl:rw', { mode: 'write' });
        await write.release();
        const read = await app.locks.acquire('acl:rw', { mode: 'read' });
        await read.release();
        const fair = await app.locks.acquire('acl:fair', { fair: true });
        await fair.release();
        await app.locks.acquire('acl:forced');
        expect(await app.locks.forceUnlock('acl:forced')).toBe(true);
        for (const key of ['acl:run', 'acl:plain', 'acl:rw', 'acl:fair', 'acl:forced']) expect([key, await raw.exists(`lock:{${key}}`)]).toEqual([key, 0]);
        expect(events.filter((e) => e.type === 'release-failed')).toEqual([]);
        expect(app.logger.at('error')).toEqual([]);
      } finally {
        subscription.unsubscribe();
      }
    });
  });

  it('hands a fair lock to a waiter of another process: its "granted" message is refused, and the waiter finds the grant on its own retry', async () => {
    const waiters = await startLockApp({ redis: redis.url });
    try {
      await using('nochannels', async (holders) => {
        const holder = await holders.locks.acquire('acl:handover', { fair: true, leaseMs: 60_000 });
        const contended = nextEvent(waiters.locks.events$, 'contended', (e) => e.key === 'acl:handover');
        const waiting = waiters.locks.acquire('acl:handover', { fair: true, waitMs: 30_000 });
        waiting.catch(() => undefined);
        await contended;
        // Asleep on the channel: only the message, or its own retry, can tell it of the handover.
        await until(async () => (await subscribers(raw, 'acl:handover')) === 1, 10_000, 'the waiter subscribed');
        await holder.release();
        const lock = await waiting;
        expect(lock.isHeld).toBe(true);
        await lock.release();
        expect(holders.logger.at('error')).toEqual([]);
      });
    } finally {
      await waiters.close();
    }
  });

  /**
   * A fair lock handed to a waiter (of a process whose user may subscribe) that missed its
   * "granted" message (the releaser's user may not publish), and then re-entered by another task of
   * the waiter's process under the same owner token: `fn` gets the waiter and the other task's handle.
   */
  async function handedWhileAnotherTaskHolds(key: string, owner: string, leaseMs: number, fn: (waiting: Promise<LockHandle>, other: LockHandle, abort: AbortController) => Promise<void>): Promise<void> {
    const waiters = await startLockApp({ redis: redis.url });
    try {
      await using('nochannels', async (holders) => {
        const holder = await holders.locks.acquire(key, { fair: true, leaseMs: 60_000 });
        const abort = new AbortController();
        // The waiter's lease is the handover lease too: it retries within half of it from its attempt.
        const waiting = waiters.locks.acquire(key, { fair: true, owner, leaseMs, waitMs: 30_000, signal: abort.signal });
        waiting.catch(() => undefined);
        // Its place names its wait once it attempted after subscribing: the handover's mark names that wait.
        await waitRegistered(raw, key, owner);
        await holder.release();
        expect(await raw.hget(`lock:{${key}}`, ':handed')).toMatch(new RegExp(`^\\S+ ${owner}$`));
        const other = await waiters.locks.acquire(key, { fair: true, owner, waitMs: 0 });
        expect(other.holdCount).toBe(2);
        await fn(waiting, other, abort);
      });
    } finally {
      await waiters.close();
    }
  }

  it('lets a fair waiter that missed its "granted" message take the grant as its own on its retry when another task of its process re-entered under the same owner token: releasing both frees the key', async () => {
    const key = 'acl:shared-owner';
    const owner = 'shared token';
    // A 4 s lease: the waiter retries 2 s after its attempt, long after the other task re-entered.
    await handedWhileAnotherTaskHolds(key, owner, 4_000, async (waiting, other) => {
      const lock = await waiting;
      // The waiter took the handed hold as its own: two holds, two tasks.
      expect(lock.holdCount).toBe(2);
      expect(await raw.hgetall(`lock:{${key}}`)).toEqual({ [owner]: '2' });
      // Its 4 s lease did not cut the other task's (30 s, the default).
      expect(await raw.pttl(`lock:{${key}}`)).toBeGreaterThan(20_000);
      await other.release();
      await lock.release();
      expect(await raw.exists(`lock:{${key}}`)).toBe(0);
    });
  });

  it('lets a fair waiter that missed its "granted" message and is aborted give back the handed hold when another task of its process re-entered under the same owner token', async () => {
    const key = 'acl:shared-owner-aborted';
    const owner = 'shared token';
    // A 60 s lease: the waiter's retry (30 s after its attempt) does not come before its abort.
    await handedWhileAnotherTaskHolds(key, owner, 60_000, async (waiting, other, abort) => {
      abort.abort(new Error('gave up'));
      await expect(waiting).rejects.toThrow('gave up');
      // The hold the handover gave went with its mark; the other task's stays.
      expect(await raw.hgetall(`lock:{${key}}`)).toEqual({ [owner]: '1' });
      await other.release();
      expect(await raw.exists(`lock:{${key}}`)).toBe(0);
    });
  });

  it('lets a waiter whose SUBSCRIBE is refused warn, and take the lock by its own retry within the holder\'s lease', async () => {
    const holders = await startLockApp({ redis: redis.url, leaseMs: 1_000 });
    try {
      await using('nochannels', async (waiters) => {
        const holder = await holders.locks.acquire('acl:unsubscribed');
        const waiting = waiters.locks.acquire('acl:unsubscribed', { waitMs: 30_000 });
        waiting.catch(() => undefined);
        await until(async () => waiters.logger.at('warn').length === 2, 10_000, 'the refused SUBSCRIBE logged');
        expect(waiters.logger.at('warn')[1]).toMatch(/could not subscribe to release channel lock:\{acl:unsubscribed\}; waiting falls back to lease-bounded retries.*NOPERM/);
        await holder.release();
        const lock = await waiting;
        expect(lock.isHeld).toBe(true);
        await lock.release();
      });
    } finally {
      await holders.close();
    }
  });

  it('warns at bootstrap when Redis has no PUBLISH (rename-command PUBLISH ""), and a waiter of another process takes the lock within the holder\'s lease', async () => {
    const renamed = await RedisServer.start(['--rename-command', 'PUBLISH', '']);
    const holders = await startLockApp({ redis: renamed.url, leaseMs: 1_000 });
    const waiters = await startLockApp({ redis: renamed.url });
    try {
      for (const app of [holders, waiters]) {
        expect(app.logger.at('warn')).toEqual([
          expect.stringMatching(
            /refused a publish on a lock channel \(.*[Uu]nknown .*command.*\)\. Locks still work, but a release cannot wake waiters.*Give the locks a Redis that lets scripts run PUBLISH \(it is renamed or disabled here, or a proxy in between does not pass it on\)\.$/,
          ),
        ]);
      }
      const holder = await holders.locks.acquire('renamed:publish');
      const waiting = waiters.locks.acquire('renamed:publish', { waitMs: 30_000 });
      await until(async () => (await subscribers(renamed.shared(), 'renamed:publish')) === 1, 10_000, 'the waiter never subscribed');
      await holder.release();
      // The release's script ran past the refused publish: the holder's hold is gone (the waiter,
      // retrying every lease, may hold the lock already).
      expect(await renamed.shared().hexists('lock:{renamed:publish}', holder.owner)).toBe(0);
      const lock = await waiting;
      await lock.release();
      expect(holders.logger.at('error')).toEqual([]);
    } finally {
      await holders.close();
      await waiters.close();
      await renamed.stop();
    }
  });

  it('gives no warning to a user granted &lock:*, whose release wakes a waiter of another process by message', async () => {
    const waiters = await startLockApp({ redis: redis.url });
    try {
      await using('lockchannels', async (holders) => {
        expect(holders.logger.at('warn')).toEqual([]);
        const holder = await holders.locks.acquire('acl:woken', { leaseMs: 120_000 });
        // Within 5 s of the release, with a 120 s lease: only the release message wakes the waiter.
        await wokenBy(() => holder.release(), waiters, 'acl:woken', 5_000);
      });
    } finally {
      await waiters.close();
    }
  });
});

/**
 * The rule the README gives for a Redis user that may touch the locks and nothing else: the lock
 * names and channels only, and the command categories the scripts and connections need.
 */
describe('a Redis ACL user limited to the lock names and channels', () => {
  const RULE = ['resetkeys', '~lock:*', 'resetchannels', '&lock:*', '-@all', '+@scripting', '+@read', '+@write', '+@pubsub', '+@connection', '+info', '+time', '+wait'];
  let redis: RedisServer;
  let raw: Redis;
  beforeAll(async () => {
    redis = await RedisServer.start();
    raw = redis.client();
    await raw.call('ACL', 'SETUSER', 'locksonly', 'reset', 'on', '>locksonly-password', ...RULE);
    await raw.set('app:data', 'not the locks');
  });
  afterAll(async () => {
    await redis?.stop();
  });

  it('starts without a warning, locks each way, wakes and hands over across processes, force-unlocks, and reaches nothing else', async () => {
    const url = `redis://locksonly:locksonly-password@127.0.0.1:${redis.port}`;
    const holders = await startLockApp({ redis: url });
    const waiters = await startLockApp({ redis: url });
    try {
      expect([...holders.logger.at('warn'), ...waiters.logger.at('warn')]).toEqual([]);
      await lockEachWay(holders.locks, 'only:each');
      const holder = await holders.locks.acquire('only:woken', { leaseMs: 120_000 });
      const token = holder.fencingToken;
      await wokenBy(() => holder.release(), waiters, 'only:woken', 5_000);
      const fair = await holders.locks.acquire('only:fair', { fair: true });
      const queued = waiters.locks.acquire('only:fair', { fair: true, waitMs: 10_000 });
      await until(async () => (await raw.llen('lock:{only:fair}:queue')) === 1, 5_000, 'the fair waiter never queued');
      await fair.release();
      const next = await queued;
      expect(next.fencingToken).toBeGreaterThan(token);
      expect(await holders.locks.forceUnlock('only:fair')).toBe(true);
      expect(await holders.locks.health()).toMatchObject({ status: 'up' });
      // The same user cannot read what is not a lock.
      const user = new Redis(url);
      try {
        await expect(user.get('app:data')).rejects.toThrow(/NOPERM/);
      } finally {
        user.disconnect();
      }
    } finally {
      await holders.close();
      await waiters.close();
    }
  });
});
