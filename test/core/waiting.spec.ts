import { describe, expect, it } from '@jest/globals';
import type { Redis } from 'ioredis';
import { performance } from 'node:perf_hooks';
import { LockBackendError, LockNotAcquiredError } from '../../lib/index.js';
import { Fixture } from '../support/children.js';
import { scriptCalls, until, type RedisServer } from '../support/redis-server.js';
import { asleep, firstAfterRelease, nextEvent, nextEvents, signalHooks, startLockApp, usePrivateLockApp, within, type LockApp } from '../support/lock-testing.js';

describe('waiting for a held lock', () => {
  let redis: RedisServer;
  let app: LockApp;
  let other: LockApp;
  let raw: Redis;
  usePrivateLockApp({}, (started) => ({ redis, raw, app, other } = started), {});

  const waitState = (a: LockApp) => (a.locks as unknown as { store: { waitState: { channels: number; waiters: number } } }).store.waitState;

  it('sleeps until the release instead of polling, and wakes on it', async () => {
    const holder = await other.locks.acquire('sleep:1');
    await raw.config('RESETSTAT');
    const contended = nextEvent(app.locks.events$, 'contended');
    const waiting = app.locks.acquire('sleep:1', { waitMs: 60_000 });
    await contended;
    // Hold for a while; a polling waiter would call Redis every few milliseconds meanwhile.
    await new Promise((r) => setTimeout(r, 500));
    const releasedAt = performance.now();
    await holder.release();
    const lock = await waiting;
    const handoffMs = performance.now() - releasedAt;
    // The holder's lease is 30 s: only the release message can explain a wake-up this fast.
    expect(handoffMs).toBeLessThan(1_000);
    // attempt, attempt once subscribed, the holder's release, the attempt after the wake-up
    expect(await scriptCalls(raw)).toBeLessThanOrEqual(4);
    await lock.release();
    expect(waitState(app)).toEqual({ channels: 0, waiters: 0 });
  });

  it('lets 40 acquisitions wait at once without a listener warning from Node', async () => {
    // In a process of its own: Node prints its warnings to that process's stderr.
    const crowd = new Fixture('crowd', [redis.url, 'crowd:1', '40']);
    try {
      await crowd.next('done');
      await crowd.exited;
      expect(crowd.stderr).not.toMatch(/Warning/);
    } finally {
      await crowd.stop();
    }
  });

  it('gives up after waitMs with LockNotAcquiredError carrying the holder\'s remaining lease', async () => {
    const holder = await other.locks.acquire('timeout:1', { leaseMs: 5_000 });
    const started = performance.now();
    const failure = (await app.locks.acquire('timeout:1', { waitMs: 300 }).catch((e: unknown) => e)) as LockNotAcquiredError;
    expect(failure).toBeInstanceOf(LockNotAcquiredError);
    expect(failure.reason).toBe('timeout');
    expect(failure.key).toBe('timeout:1');
    expect(failure.waitedMs).toBeGreaterThanOrEqual(300);
    expect(performance.now() - started).toBeGreaterThanOrEqual(300);
    expect(failure.retryAfterMs).toBeGreaterThan(4_000);
    expect(failure.retryAfterMs).toBeLessThanOrEqual(5_000);
    expect(failure.message).toMatch(/Lock "timeout:1" is held by another owner; gave up after waiting \d+ ms\. The holder's lease ends in \d+ ms/);
    expect(waitState(app)).toEqual({ channels: 0, waiters: 0 });
    await holder.release();
  });

  // waitMs: Infinity from the module's options and from the call (over a module's short waitMs), for
  // one key and for a group. The holder's lease is 300 ms, renewed every 100 ms by its watchdog, so
  // the waiter sleeps and tries again about every 300 ms; it must still be waiting after 20 renewals
  // (2 s, 10 times the module's 200 ms), then take the lock at the release.
  it.each([
    ['the module', { waitMs: Infinity }, {}, ['forever:1']],
    ['the call', { waitMs: 200 }, { waitMs: Infinity }, ['forever:2']],
    ['the call, for a group', { waitMs: 200 }, { waitMs: Infinity }, ['forever:3', 'forever:4']],
  ] as const)('waits for ever with waitMs: Infinity from %s, through many sleeps, and takes the lock at the release', async (_, moduleOptions, call, keys) => {
    const holderApp = await startLockApp({ redis: redis.url, leaseMs: 300 });
    const waiterApp = await startLockApp({ redis: redis.url, ...moduleOptions });
    try {
      const holder = await holderApp.locks.acquire(keys.at(-1)!);
      const contended = nextEvent(waiterApp.locks.events$, 'contended');
      let settled: string | undefined;
      const waiting: Promise<{ isHeld: boolean; release(): Promise<void> }> =
        keys.length === 1 ? waiterApp.locks.acquire(keys[0], call) : waiterApp.locks.acquire([...keys], call);
      waiting.then(
        () => (settled = 'acquired'),
        (e: unknown) => (settled = String(e)),
      );
      await contended;
      await nextEvents(holderApp.locks.events$, 'renewed', 20, 20_000);
      expect(settled).toBeUndefined();
      expect(waitState(waiterApp)).toMatchObject({ waiters: 1 });
      await holder.release();
      const lock = await waiting;
      expect(lock.isHeld).toBe(true);
      await lock.release();
    } finally {
      await waiterApp.close();
      await holderApp.close();
    }
  });

  it('makes one attempt with waitMs 0 and tryAcquire', async () => {
    const holder = await other.locks.acquire('once:1');
    const failure = (await app.locks.acquire('once:1', { waitMs: 0 }).catch((e: unknown) => e)) as LockNotAcquiredError;
    expect(failure.reason).toBe('contended');
    expect(String(failure)).toMatch(
      /^LockNotAcquiredError: Lock "once:1" is held by another owner and the caller chose not to wait\. The holder's lease ends in \d+ ms unless renewed\. Retry later, or raise waitMs if waiting longer is acceptable\.$/,
    );
    expect(await app.locks.tryAcquire('once:1')).toBeNull();
    await holder.release();
    const mine = await app.locks.tryAcquire('once:1');
    expect(mine?.holdCount).toBe(1);
    await mine?.release();
  });

  it.each([
    ['one key', ['no-expiry:1']],
    ['several keys', ['no-expiry:a', 'no-expiry:b']],
  ])('checks a lock key without expiry again every second (%s): a waiter gets in soon after it is deleted with no release message', async (_, keys) => {
    // Written by something else, with no expiry: no lease bounds the waiter's sleep, and deleting it
    // publishes nothing. Only the waiter's own check of the key can find it gone.
    await raw.hset(`lock:{${keys[0]}}`, 'someone-else', '1');
    const waiting: Promise<{ release(): Promise<void> }> =
      keys.length === 1 ? app.locks.acquire(keys[0]!, { waitMs: 60_000 }) : app.locks.acquire(keys, { waitMs: 60_000 });
    await until(async () => asleep(app, keys[0]!) === 1, 10_000, 'the waiter asleep');
    await raw.del(`lock:{${keys[0]}}`);
    // Within a few seconds, against the 60 s the wait would otherwise sleep.
    const lock = await within(waiting, 5_000);
    await lock.release();
    for (const key of keys) expect(await raw.exists(`lock:{${key}}`)).toBe(0);
  });

  it('stops an aborted wait at once and leaves no subscription or waiter behind', async () => {
    const holder = await other.locks.acquire('abort:1');
    const controller = new AbortController();
    const contended = nextEvent(app.locks.events$, 'contended');
    const waiting = app.locks.acquire('abort:1', { waitMs: 60_000, signal: controller.signal });
    await contended;
    const abortedAt = performance.now();
    controller.abort(new Error('user went away'));
    await expect(waiting).rejects.toThrow('user went away');
    // At once: well under a second, against the 60 s the wait would otherwise take.
    expect(performance.now() - abortedAt).toBeLessThan(1_000);
    expect(waitState(app)).toEqual({ channels: 0, waiters: 0 });
    expect(await raw.keys('lock:{abort:1}*')).toEqual(expect.arrayContaining(['lock:{abort:1}']));
    expect(await raw.hgetall('lock:{abort:1}')).toEqual({ [holder.owner]: '1' });
    await holder.release();
  });

  it("leaves nothing on the service's shutdown signal after waits with a signal of their own (one key, several keys; granted and aborted)", async () => {
    // The shutdown signal lives as long as the service. A wait used to join it to the caller's
    // signal with AbortSignal.any, which leaves an entry on it per wait: Node 20 never removes them.
    const shutdown = (app.locks as unknown as { shutdown: AbortController }).shutdown.signal;
    const hooks = () => signalHooks(shutdown);
    const before = hooks();
    for (const keys of ['abort:3', ['abort:3', 'abort:4']] as const) {
      for (const outcome of ['granted', 'aborted'] as const) {
        const holder = await other.locks.acquire('abort:3');
        const controller = new AbortController();
        const contended = nextEvent(app.locks.events$, 'contended');
        const waiting = app.locks.acquire(keys as never, { waitMs: 60_000, signal: controller.signal }) as Promise<{ release(): Promise<void> }>;
        await contended;
        if (outcome === 'granted') {
          await holder.release();
          await (await waiting).release();
        } else {
          controller.abort(new Error('user went away'));
          await expect(waiting).rejects.toThrow('user went away');
          await holder.release();
        }
      }
    }
    expect(hooks()).toEqual(before);
  });

  it('rejects at once when the signal is already aborted', async () => {
    await expect(app.locks.acquire('abort:2', { signal: AbortSignal.abort(new Error('too late')) })).rejects.toThrow('too late');
    expect(await app.locks.isLocked('abort:2')).toBe(false);
  });

  it('serves every waiter in turn, each holding the lock alone', async () => {
    const holder = await other.locks.acquire('queue:1');
    const order: number[] = [];
    const waiters = [0, 1, 2].map((i) =>
      app.locks.run('queue:1', async () => {
        order.push(i);
        expect(await app.locks.holdCount('queue:1')).toBe(1);
      }, { waitMs: 30_000 }),
    );
    await new Promise((r) => setImmediate(r));
    await holder.release();
    await Promise.all(waiters);
    expect(order.sort()).toEqual([0, 1, 2]);
  });

  it('gives the lock first to a waiter of the releasing process: its attempt goes right behind the release', async () => {
    // Woken by the release message instead, either waiter could win.
    expect(await firstAfterRelease(app, other, 'behind', 20)).toEqual(Array(20).fill('mine'));
  });

  it('hands the lock to a waiter of the releasing process inside the release, with its lease and a fresh token', async () => {
    const key = 'behind:handed';
    const holder = await app.locks.acquire(key);
    const waiting = app.locks.acquire(key, { waitMs: 30_000, leaseMs: 120_000 });
    await until(async () => asleep(app, key) === 1, 10_000, 'the waiter asleep');
    const before = await scriptCalls(raw);
    await holder.release();
    const handed = await waiting;
    // One script call: the release. A waiter that sent its own attempt would make it two.
    expect((await scriptCalls(raw)) - before).toBe(1);
    expect(handed.fencingToken).toBeGreaterThan(holder.fencingToken);
    expect(await raw.hgetall(`lock:{${key}}`)).toEqual({ [handed.owner]: '1' });
    // The waiter's lease (120 s), not the default (30 s) the holder had.
    expect(await raw.pttl(`lock:{${key}}`)).toBeGreaterThan(60_000);
    await handed.release();
    expect(await raw.exists(`lock:{${key}}`)).toBe(0);
  });

  it('gives back a lock handed to a waiter whose wait ran out while the release was held up', async () => {
    const key = 'behind:late';
    const holder = await app.locks.acquire(key);
    const waiting = app.locks.acquire(key, { waitMs: 1_000 });
    const failed = waiting.then(() => undefined, (error: unknown) => error);
    await until(async () => asleep(app, key) === 1, 10_000, 'the waiter asleep');
    // Redis holds every write (the release, then the waiter's last attempt) until the waiter gave
    // up: its 1 s wait, then its attempt's 1 s bound.
    await raw.client('PAUSE', 60_000, 'WRITE');
    let released: Promise<unknown>;
    try {
      // The release gives up waiting at its own 1 s bound; it was sent all the same.
      released = holder.release().then(() => 'released', (error: unknown) => error);
      expect(await failed).toBeInstanceOf(LockBackendError);
    } finally {
      await raw.client('UNPAUSE');
    }
    expect(await released).toBeInstanceOf(LockBackendError);
    // The release ran once the pause ended and handed the lock to the waiter, which was gone: given back.
    await until(async () => (await raw.exists(`lock:{${key}}`)) === 0, 10_000, 'the late grant given back');
    expect(await app.locks.acquire(key, { waitMs: 0 }).then((h) => h.release())).toBeUndefined();
  });

  it('wakes a waiter of another process at a release that takes a local waiter along', async () => {
    const key = 'behind:announced';
    // Leases of 120 s: no renewal (every 40 s) runs a script during the test.
    const holder = await app.locks.acquire(key, { leaseMs: 120_000 });
    let theirsDone = false;
    const theirs = other.locks.acquire(key, { waitMs: 60_000 }).finally(() => (theirsDone = true));
    await until(async () => asleep(other, key) === 1, 10_000, 'the other process\'s waiter asleep');
    const mine = app.locks.acquire(key, { waitMs: 60_000, leaseMs: 120_000 });
    await until(async () => asleep(app, key) === 1, 10_000, 'the local waiter asleep');
    const listener = redis.client();
    const messages: string[] = [];
    listener.on('message', (_channel: string, message: string) => messages.push(message));
    await listener.subscribe(`lock:{${key}}`);
    const before = await scriptCalls(raw);
    await holder.release();
    const handed = await mine;
    expect(await raw.hgetall(`lock:{${key}}`)).toEqual({ [handed.owner]: '1' });
    await until(async () => messages.length > 0, 10_000, 'the release announced');
    expect(messages).toEqual(['released']);
    // The release, then the other process's attempt: only the release's message can wake that
    // waiter now (the lease it last saw is 120 s), and its attempt is refused.
    await until(async () => (await scriptCalls(raw)) - before >= 2, 10_000, 'the other process\'s waiter trying again');
    await until(async () => asleep(other, key) === 1, 10_000, 'the other process\'s waiter asleep again');
    expect(theirsDone).toBe(false);
    listener.disconnect();
    await handed.release();
    await (await theirs).release();
  });

  it('hands the lock to a fair waiter of another process first when one is queued: the local waiter tries again', async () => {
    const key = 'behind:fair-queued';
    const holder = await app.locks.acquire(key);
    const order: string[] = [];
    const theirs = other.locks.run(key, () => void order.push('theirs'), { fair: true, waitMs: 30_000 });
    await until(async () => asleep(other, key) === 1, 10_000, 'the fair waiter asleep');
    const mine = app.locks.run(key, () => void order.push('mine'), { waitMs: 30_000 });
    await until(async () => asleep(app, key) === 1, 10_000, 'the local waiter asleep');
    await holder.release();
    await Promise.all([theirs, mine]);
    expect(order).toEqual(['theirs', 'mine']);
  });

  it('does not keep the lock in one process while a waiter of another process waits', async () => {
    const key = 'behind:streak';
    const holder = await app.locks.acquire(key);
    const order: string[] = [];
    const mine = Array.from({ length: 40 }, (_, i) => app.locks.run(key, () => void order.push(`mine ${i}`), { waitMs: 30_000 }));
    await until(async () => asleep(app, key) === 40, 10_000, 'local waiters asleep');
    const theirs = other.locks.run(key, () => void order.push('theirs'), { waitMs: 30_000 });
    await until(async () => asleep(other, key) === 1, 10_000, 'the other waiter asleep');
    await holder.release();
    await Promise.all([...mine, theirs]);
    // Every release taking a local waiter along would serve all 40 first. After MAX_HANDOFFS_IN_A_ROW
    // (4) such releases, one wakes waiters by its message only, in this process and the other alike.
    expect(order).toHaveLength(41);
    expect(order.indexOf('theirs')).toBeLessThan(40);
  });

  it('wakes a waiter whose attempt behind a release was refused at the next release', async () => {
    const key = 'behind:refused';
    const stale = await app.locks.acquire(key);
    const waiting = app.locks.acquire(key, { waitMs: 30_000 });
    await until(async () => asleep(app, key) === 1, 10_000, 'the waiter asleep');
    // The lock is taken from under the holder, which does not know it yet.
    await raw.del(`lock:{${key}}`);
    const thief = await other.locks.acquire(key, { waitMs: 0 });
    await stale.release();
    // The release found nothing of its own and announced nothing; the attempt right behind it was refused.
    await until(async () => asleep(app, key) === 1, 10_000, 'the waiter asleep again');
    await thief.release();
    // The thief's lease is 30 s: only its release message wakes the waiter this early.
    const started = performance.now();
    await (await waiting).release();
    expect(performance.now() - started).toBeLessThan(5_000);
  });
});
