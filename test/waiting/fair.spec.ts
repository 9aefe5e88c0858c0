import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import type { Redis } from 'ioredis';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { performance } from 'node:perf_hooks';
import { LockNotAcquiredError } from '../../lib/index.js';
import type { LockStore } from '../../lib/store/lock-store.js';
import { Fixture } from '../support/children.js';
import { RedisServer, redisNowMs, scriptCalls, until } from '../support/redis-server.js';
import { asleep, elsewhere, nextEvent, stallInTimer, startLockApp, waitRegistered, usePrivateLockApp, within, type LockApp } from '../support/lock-testing.js';

const QUEUE_TIMEOUT = 1_000;

/** The Redis names of `key`'s fair queue: the list, its place timeouts and its handover leases. */
const queueKeys = (key: string) => [`lock:{${key}}:queue`, `lock:{${key}}:queue:timeouts`, `lock:{${key}}:queue:leases`];

describe('fair mode', () => {
  let redis: RedisServer;
  let raw: Redis;
  let app: LockApp;
  usePrivateLockApp({ fairQueueTimeoutMs: QUEUE_TIMEOUT }, (started) => ({ redis, raw, app } = started));

  it("keeps a fair waiter's place when a waiter with a shorter place timeout (another service's) queues after it", async () => {
    // The places share the queue's keys: before, each attempt set their expiry to 2 of its own
    // place timeouts, and the short one's attempt cut the patient waiter's place with it.
    const key = 'fair:mixed-places';
    const store = (app.locks as unknown as { store: LockStore }).store;
    const holder = await app.locks.acquire(key, { fair: true });
    let handed = false;
    try {
      expect(await store.acquire({ key, owner: 'patient', leaseMs: 5_000, fair: true, queueTimeoutMs: 10_000 })).toMatchObject({ granted: false });
      expect(await store.acquire({ key, owner: 'hasty', leaseMs: 5_000, fair: true, queueTimeoutMs: 300 })).toMatchObject({ granted: false });
      for (const name of queueKeys(key)) expect(await raw.pttl(name)).toBeGreaterThan(19_000);
      // Past 2 of the hasty waiter's place timeouts, the release hands the lock to the patient one.
      const from = await redisNowMs(raw);
      await until(async () => (await redisNowMs(raw)) > from + 700, 5_000, '700 ms of Redis time');
      await holder.release();
      handed = (await raw.hget(`lock:{${key}}`, 'patient')) === '1';
      expect(handed).toBe(true);
    } finally {
      if (handed) expect(await store.release(key, 'patient')).toBe(0);
      else await store.abandon(key, 'patient', 'exclusive', true);
    }
  });

  // One place per owner, not per wait (README, "Waiting and fairness"): the place names the latest
  // wait of the owner to ask, and a wait that leaves takes the place of the others with it.
  it('gives the waits of one owner token one place: when the later one gives up, the earlier one is served after a waiter that came after it', async () => {
    const key = 'fair:token-place';
    const queue = `lock:{${key}}:queue`;
    const holder = await app.locks.acquire(key, { fair: true });
    const served: string[] = [];
    const wait = (owner: string, waitMs: number) =>
      app.locks.acquire(key, { owner, fair: true, waitMs }).then(async (lock) => {
        served.push(owner);
        await lock.release();
      });
    const first = wait('token-q', 30_000);
    await waitRegistered(raw, key, 'token-q');
    const other = wait('other-q', 30_000);
    await waitRegistered(raw, key, 'other-q');
    expect(await raw.lrange(queue, 0, -1)).toEqual(['token-q', 'other-q']);
    // A second wait under the token asks too (the place now names it), gives up, and leaves.
    await expect(wait('token-q', 100)).rejects.toBeInstanceOf(LockNotAcquiredError);
    expect((await raw.lrange(queue, 0, -1))[0]).toBe('other-q');
    await holder.release();
    await Promise.all([first, other]);
    expect(served).toEqual(['other-q', 'token-q']);
  });

  it('gives the waits of one owner token one place, which names the latest to ask: the release hands the lock to that wait, and the earlier one re-enters it', async () => {
    const key = 'fair:token-latest';
    const leases = `lock:{${key}}:queue:leases`;
    const holder = await app.locks.acquire(key, { fair: true });
    const holdCounts: Record<string, number> = {};
    const wait = (label: string) =>
      app.locks.acquire(key, { owner: 'token-l', fair: true, waitMs: 30_000 }).then((lock) => {
        holdCounts[label] = lock.holdCount;
        return lock;
      });
    const first = wait('first');
    await waitRegistered(raw, key, 'token-l');
    const firstPlace = await raw.hget(leases, 'token-l');
    const second = wait('second');
    await until(async () => (await raw.hget(leases, 'token-l')) !== firstPlace, 5_000, 'the second wait named in the place');
    expect(await raw.lrange(`lock:{${key}}:queue`, 0, -1)).toEqual(['token-l']);
    await holder.release();
    const locks = await Promise.all([first, second]);
    // A place per wait would hand it to the first (hold count 1), which the second would re-enter.
    expect(holdCounts).toEqual({ first: 2, second: 1 });
    for (const lock of locks.reverse()) await lock.release();
    expect(await raw.exists(`lock:{${key}}`)).toBe(0);
  });

  it('frees a lock handed over by message when the process holding it shuts down: the handover\'s mark goes with its holds', async () => {
    const key = 'fair:handed-shutdown';
    const waiters = await startLockApp({ redis: redis.url });
    let open = true;
    try {
      const holder = await app.locks.acquire(key, { fair: true });
      const contended = nextEvent(waiters.locks.events$, 'contended', (e) => e.key === key);
      const waiting = waiters.locks.acquire(key, { fair: true, waitMs: 10_000 });
      waiting.catch(() => undefined);
      // Queued under its wait id, so the release's message reaches it.
      await waitRegistered(raw, key, (await contended).owner);
      await holder.release();
      const lock = await waiting;
      // Taken from the message: the mark, naming its wait, stays while it holds the lock.
      expect(await raw.hgetall(`lock:{${key}}`)).toEqual({ [lock.owner]: '1', ':handed': expect.stringMatching(new RegExp(`^\\S+ ${lock.owner}$`)) });
      await waiters.close();
      open = false;
      expect(await raw.exists(`lock:{${key}}`)).toBe(0);
    } finally {
      if (open) await waiters.close();
    }
  });

  it('grants in request order across 2 processes', async () => {
    const key = 'fair:order';
    const children = [0, 1].map(() => new Fixture('fair-waiter', [redis.url, key, String(QUEUE_TIMEOUT)]));
    try {
      await Promise.all(children.map((c) => c.next('ready')));
      const holder = await app.locks.acquire(key, { fair: true });
      for (let id = 0; id < 8; id++) {
        const child = children[id % 2]!;
        child.send({ type: 'wait', id });
        await child.next('queued', (m) => m.owner === `waiter-${id}`);
      }
      await holder.release();
      await Promise.all(children.map((c, i) => c.next('granted', (m) => m.id === 6 + i)));
      expect(await raw.lrange('order', 0, -1)).toEqual(['0', '1', '2', '3', '4', '5', '6', '7']);
      for (const c of children) c.send({ type: 'finish' });
      await Promise.all(children.map((c) => c.next('done')));
      expect(await raw.exists(`lock:{${key}}:queue`, `lock:{${key}}:queue:timeouts`)).toBe(0);
    } finally {
      await Promise.all(children.map((c) => c.stop()));
    }
  });

  /**
   * `key` held here, the `fair-waiter` child's waiter `waiter-<id>` queued first and a waiter of
   * this process (`behind`, whose owner is `owner`) second; then the child is killed (SIGKILL).
   */
  async function behindCrashedWaiter(key: string, child: Fixture, id: number) {
    await child.next('ready');
    const holder = await app.locks.acquire(key, { fair: true });
    child.send({ type: 'wait', id });
    await child.next('queued');
    const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === key && e.owner !== holder.owner);
    const behind = app.locks.acquire(key, { fair: true, waitMs: 30_000 });
    const { owner } = await contended;
    expect(await raw.lrange(`lock:{${key}}:queue`, 0, -1)).toEqual([`waiter-${id}`, owner]);
    child.kill('SIGKILL');
    await child.exited;
    return { holder, behind, owner };
  }

  it('does not stall behind a waiter that crashed (SIGKILL)', async () => {
    const key = 'fair:crash';
    const child = new Fixture('fair-waiter', [redis.url, key, String(QUEUE_TIMEOUT)]);
    try {
      const { holder, behind } = await behindCrashedWaiter(key, child, 99);
      const releasedAt = performance.now();
      await holder.release();
      const lock = await behind;
      // The dead head is handed the lock for at most the queue timeout, then the next waiter goes.
      expect(performance.now() - releasedAt).toBeLessThan(QUEUE_TIMEOUT + 1_000);
      expect(await raw.lrange(`lock:{${key}}:queue`, 0, -1)).toEqual([]);
      await lock.release();
    } finally {
      await child.stop();
    }
  });

  it('skips a crashed waiter whose place lapsed: the release hands the lock to the live waiter behind it, not to the dead one', async () => {
    const key = 'fair:lapsed';
    const child = new Fixture('fair-waiter', [redis.url, key, String(QUEUE_TIMEOUT)]);
    try {
      const { holder, behind, owner } = await behindCrashedWaiter(key, child, 98);
      // The dead waiter's place ends QUEUE_TIMEOUT after its last attempt; the live one keeps
      // refreshing its own. Once Redis's clock is past that end, the dead place has lapsed.
      const deadPlaceEnds = Number(await raw.zscore(`lock:{${key}}:queue:timeouts`, 'waiter-98'));
      expect(deadPlaceEnds).toBeGreaterThan(0);
      await until(async () => (await redisNowMs(raw)) > deadPlaceEnds, 5_000, "Redis's clock never passed the dead waiter's place");
      await holder.release();
      // Read at once, well within a handover lease: had the dead waiter been handed the lock, it would still hold it.
      expect(await raw.hget(`lock:{${key}}`, 'waiter-98')).toBeNull();
      expect(await raw.hget(`lock:{${key}}`, owner)).toBe('1');
      const lock = await behind;
      expect(lock.owner).toBe(owner);
      expect(await raw.exists(...queueKeys(key))).toBe(0);
      await lock.release();
    } finally {
      await child.stop();
    }
  });

  it('hands a lock whose lease ran out to the waiter at the head of the queue, not to a newcomer (no release handed it over)', async () => {
    const key = 'fair:expired';
    // The holder is another process, killed, so nothing of it can release the lock (a holder that
    // lives gives its hold back when its lease runs out locally, and that release hands the lock over).
    const holder = new Fixture('fenced-holder', [redis.url, key, '1000']);
    // The waiter's place lasts 20 s, so it stays at the head while the waiter is stopped.
    const child = new Fixture('fair-waiter', [redis.url, key, '20000']);
    try {
      await Promise.all([holder.next('holding'), child.next('ready')]);
      child.send({ type: 'wait', id: 1 });
      await child.next('queued');
      child.kill('SIGSTOP'); // it cannot try again when the lease ends
      holder.kill('SIGKILL');
      await holder.exited;
      await until(async () => (await raw.exists(`lock:{${key}}`)) === 0, 5_000, 'the lease never ended');
      expect(await app.locks.tryAcquire(key, { fair: true })).toBeNull();
      // The newcomer's attempt handed the free lock to the head, and left the queue when refused.
      expect(await raw.hget(`lock:{${key}}`, 'waiter-1')).toBe('1');
      expect(await raw.lrange(`lock:{${key}}:queue`, 0, -1)).toEqual([]);
      child.kill('SIGCONT');
      await child.next('granted', (m) => m.id === 1);
    } finally {
      child.kill('SIGCONT');
      await Promise.all([holder.stop(), child.stop()]);
    }
  });

  it('lets the waiter at the head take a lock whose holder crashed with its own attempt, and leaves nothing of the queue behind', async () => {
    const key = 'fair:head-takes';
    // Killed, the holder releases nothing: the lock frees only when its 1 s lease runs out, and no
    // release hands it over; the waiter's next attempt, at the head of the queue, takes it itself.
    const holder = new Fixture('fenced-holder', [redis.url, key, '1000']);
    const queue = queueKeys(key);
    try {
      await holder.next('holding');
      const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === key);
      const waiting = app.locks.acquire(key, { fair: true, waitMs: 10_000 });
      const { owner } = await contended;
      expect(await raw.lrange(queue[0]!, 0, -1)).toEqual([owner]);
      holder.kill('SIGKILL');
      await holder.exited;
      const lock = await waiting;
      expect(await raw.hget(`lock:{${key}}`, ':handed')).toBeNull(); // taken, not handed over
      expect(await raw.exists(...queue)).toBe(0);
      await lock.release();
    } finally {
      await holder.stop();
    }
  });

  it('keeps a waiter\'s place for as long as it waits, behind a holder whose lease is 3 queue timeouts', async () => {
    // The place lasts QUEUE_TIMEOUT (1 s) from each attempt, and the waiter comes back every half
    // of its handover lease (min(leaseMs, QUEUE_TIMEOUT) / 2), not at the end of the holder's 3 s
    // lease: its place never lapses, so nobody arriving later goes before it.
    const key = 'fair:place';
    const holder = await app.locks.acquire(key, { fair: true, leaseMs: 3_000, watchdog: true });
    const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === key && e.owner !== holder.owner);
    const waiting = elsewhere(() => app.locks.acquire(key, { fair: true, waitMs: 10_000 }));
    try {
      const { owner } = await contended;
      // Asleep: past the attempt it makes once it listens for releases, which refreshes the place too.
      await until(async () => asleep(app, key) === 1, 5_000, 'the waiter asleep');
      const firstPlaceEnds = Number(await raw.zscore(`lock:{${key}}:queue:timeouts`, owner));
      expect(firstPlaceEnds - (await redisNowMs(raw))).toBeLessThanOrEqual(QUEUE_TIMEOUT);
      await until(async () => (await redisNowMs(raw)) > firstPlaceEnds + 100, 5_000, "Redis's clock never passed the first place's end");
      expect(Number(await raw.zscore(`lock:{${key}}:queue:timeouts`, owner))).toBeGreaterThan(firstPlaceEnds);
      expect(await raw.lrange(`lock:{${key}}:queue`, 0, -1)).toEqual([owner]);
    } finally {
      // Also when a check above failed: the holder's renewals must not reach the next test.
      await holder.release();
      await (await waiting).release();
    }
  });

  it('lets the queue of a crashed waiter expire 2 queue timeouts after its last attempt, while the lock stays held', async () => {
    const key = 'fair:orphan-queue';
    const child = new Fixture('fair-waiter', [redis.url, key, '300']);
    try {
      await child.next('ready');
      const holder = await app.locks.acquire(key, { fair: true });
      child.send({ type: 'wait', id: 7 });
      await child.next('queued');
      child.kill('SIGKILL');
      await child.exited;
      const queue = queueKeys(key);
      expect(await raw.exists(...queue)).toBe(3);
      await until(async () => (await raw.exists(...queue)) === 0, 5_000, 'the queue outlived 2 queue timeouts of 300 ms');
      expect(holder.isHeld).toBe(true);
      await holder.release();
    } finally {
      await child.stop();
    }
  });

  it('leaves no queue entry and no subscription behind an aborted or timed-out wait', async () => {
    const key = 'fair:abort';
    const holder = await app.locks.acquire(key, { fair: true });
    const controller = new AbortController();
    const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === key);
    const waiting = app.locks.acquire(key, { fair: true, waitMs: 60_000, signal: controller.signal });
    await contended;
    expect(await raw.llen(`lock:{${key}}:queue`)).toBe(1);
    controller.abort(new Error('client went away'));
    await expect(waiting).rejects.toThrow('client went away');
    expect(await raw.exists(`lock:{${key}}:queue`, `lock:{${key}}:queue:timeouts`)).toBe(0);
    await expect(app.locks.acquire(key, { fair: true, waitMs: 100 })).rejects.toBeInstanceOf(LockNotAcquiredError);
    expect(await app.locks.tryAcquire(key, { fair: true })).toBeNull();
    expect(await raw.exists(`lock:{${key}}:queue`, `lock:{${key}}:queue:timeouts`)).toBe(0);
    const store = (app.locks as unknown as { store: { waitState: { channels: number; waiters: number } } }).store;
    expect(store.waitState).toEqual({ channels: 0, waiters: 0 });
    // The subscription itself is dropped on the next turn of the waiter's event loop.
    await until(async () => ((await raw.call('PUBSUB', 'CHANNELS', `lock:{${key}}`)) as string[]).length === 0, 10_000, 'the release channel was never unsubscribed');
    await holder.release();
  });

  describe('handover inside the release', () => {
    // A queue timeout of 20 s and a lease of 60 s: a waiter sleeps up to 10 s between attempts, so
    // any Redis call it makes in these tests is one the handover caused, not its timer.
    let patient: LockApp;
    let other: LockApp;
    beforeAll(async () => {
      patient = await startLockApp({ redis: redis.url, fairQueueTimeoutMs: 20_000, leaseMs: 60_000 });
      other = await startLockApp({ redis: redis.url, leaseMs: 60_000 });
    });
    afterAll(async () => {
      await patient?.close();
      await other?.close();
    });

    /** Starts a fair wait on `key` in `waiterApp` and resolves once it sleeps with its wait registered. */
    async function queuedWaiter(key: string, options: { watchdog?: boolean; owner?: string } = {}, waiterApp = patient) {
      const contended = nextEvent(waiterApp.locks.events$, 'contended', (e) => e.key === key);
      const waiting = waiterApp.locks.acquire(key, { fair: true, waitMs: 60_000, ...options });
      const { owner } = await contended;
      // The second attempt (after subscribing) registers the wait id; then the waiter sleeps.
      await waitRegistered(raw, key, owner);
      return { waiting, owner };
    }

    // The second row: the handover message names the owner, and an owner token may have spaces in it.
    it.each([
      ['its own owner token', 'fair:handover', undefined],
      ['an owner token with spaces in it', 'fair:handover-spaces', 'night shift 7'],
    ])('gives the lock to the next waiter with no Redis call of its own (release in another process; %s)', async (_name, key, ownerOption) => {
      const holder = await other.locks.acquire(key, { fair: true });
      const { waiting, owner } = await queuedWaiter(key, ownerOption === undefined ? {} : { owner: ownerOption });
      if (ownerOption !== undefined) expect(owner).toBe(ownerOption);
      await raw.config('RESETSTAT');
      await holder.release();
      // Well inside the 10 s the waiter would sleep if the message had missed it.
      const lock = await within(waiting, 5_000);
      // One script ran: the holder's release. The waiter took the lock without asking.
      expect(await scriptCalls(raw)).toBe(1);
      expect(lock.holdCount).toBe(1);
      expect(lock.fencingToken).toBeGreaterThan(holder.fencingToken);
      expect(await raw.hget(`lock:{${key}}`, owner)).toBe('1');
      expect(await raw.exists(...queueKeys(key))).toBe(0);
      // Held for the handover lease (the queue timeout) until the watchdog renews it to the lease.
      expect(await raw.pttl(`lock:{${key}}`)).toBeLessThanOrEqual(20_000);
      await lock.release();
      expect(await raw.exists(`lock:{${key}}`)).toBe(0);
    });

    it('wakes a waiter of the releasing process from the release reply, without the message', async () => {
      const key = 'fair:handover-local';
      const holder = await patient.locks.acquire(key, { fair: true });
      const { waiting } = await queuedWaiter(key);
      // No subscriber: the release message cannot reach anyone.
      expect(Number(await raw.call('CLIENT', 'KILL', 'TYPE', 'pubsub'))).toBe(1);
      await raw.config('RESETSTAT');
      await holder.release();
      const lock = await waiting;
      expect(await scriptCalls(raw)).toBe(1);
      expect(lock.holdCount).toBe(1);
      await lock.release();
    });

    it('sets the full fixed lease (no watchdog) of a handed-over lock before the acquisition returns', async () => {
      const key = 'fair:handover-fixed';
      const holder = await other.locks.acquire(key, { fair: true });
      const { waiting } = await queuedWaiter(key, { watchdog: false });
      await holder.release();
      const lock = await waiting;
      // Handed over for the queue timeout (20 s); the waiter's own lease is 60 s.
      expect(await raw.pttl(`lock:{${key}}`)).toBeGreaterThan(20_000);
      await lock.release();
    });

    it('renews a handed-over lock from its short handover lease to the full lease (watchdog)', async () => {
      // Handover lease = queue timeout = 3 s, lease 60 s: unless the watchdog knows the lock was
      // handed over for 3 s only, it renews at 20 s, long after Redis dropped it. It renews at a
      // third of the handover lease (1 s after the waiter's last attempt), not at its end.
      const quick = await startLockApp({ redis: redis.url, fairQueueTimeoutMs: 3_000, leaseMs: 60_000 });
      try {
        const key = 'fair:handover-renewed';
        const holder = await other.locks.acquire(key, { fair: true });
        const { waiting } = await queuedWaiter(key, {}, quick);
        const renewed = nextEvent(quick.locks.events$, 'renewed', (e) => e.key === key, 5_000).then(() => performance.now());
        const releasedAt = performance.now();
        await holder.release();
        const lock = await waiting;
        expect((await renewed) - releasedAt).toBeLessThan(2_000);
        expect(await raw.pttl(`lock:{${key}}`)).toBeGreaterThan(30_000);
        expect(lock.isHeld).toBe(true);
        await lock.release();
      } finally {
        await quick.close();
      }
    });

    it('counts a fair re-entry into a handed-over lock as a re-entry (`:handed` still names its holder): the inner release leaves it held', async () => {
      const key = 'fair:handover-reentered';
      const holder = await other.locks.acquire(key, { fair: true });
      const { waiting, owner } = await queuedWaiter(key);
      const waitId = (await raw.hget(`lock:{${key}}:queue:leases`, owner))!.split(' ')[1];
      await holder.release();
      const lock = await waiting;
      expect(await raw.hget(`lock:{${key}}`, ':handed')).toBe(`${waitId} ${owner}`);
      await lock.run(async () => {
        const inner = await patient.locks.acquire(key, { fair: true });
        expect(inner.holdCount).toBe(2);
        expect(await raw.hget(`lock:{${key}}`, owner)).toBe('2');
        await inner.release();
      });
      expect(lock.isHeld).toBe(true);
      expect(await raw.hget(`lock:{${key}}`, owner)).toBe('1');
      await lock.release();
      expect(await raw.exists(`lock:{${key}}`)).toBe(0);
    });

    // The handover mark names the wait, not only the owner: before, a fair acquisition of another
    // process under the token took the mark for its own handover (hold count 1, not 2), and the
    // first process's release freed the lock under it.
    it('lets a fair acquisition of another process under the owner token re-enter a lock handed to a wait of the first: the first release leaves it held', async () => {
      const key = 'fair:handover-token';
      const joiner = await startLockApp({ redis: redis.url, leaseMs: 60_000 });
      try {
        const holder = await other.locks.acquire(key, { fair: true });
        const { waiting } = await queuedWaiter(key, { owner: 'shift-3' });
        await holder.release();
        const lock = await waiting;
        const joined = await joiner.locks.acquire(key, { fair: true, owner: 'shift-3', waitMs: 0 });
        expect(joined.holdCount).toBe(2);
        expect(await raw.hget(`lock:{${key}}`, 'shift-3')).toBe('2');
        await lock.release();
        expect(await raw.hget(`lock:{${key}}`, 'shift-3')).toBe('1');
        expect(await other.locks.tryAcquire(key)).toBeNull();
        expect(joined.isHeld).toBe(true);
        await joined.release();
        expect(await raw.exists(`lock:{${key}}`)).toBe(0);
      } finally {
        await joiner.close();
      }
    });

    it('lets a waiter that missed the message take the grant as its own on its next attempt, not as a re-entry', async () => {
      const key = 'fair:handover-missed';
      const holder = await other.locks.acquire(key, { fair: true });
      const { waiting, owner } = await queuedWaiter(key);
      expect(Number(await raw.call('CLIENT', 'KILL', 'TYPE', 'pubsub'))).toBe(1);
      await raw.config('RESETSTAT');
      await holder.release(); // handed over while the waiter's subscriber is reconnecting
      const lock = await waiting; // its reconnect wakes it, and its attempt finds the grant
      expect(await scriptCalls(raw)).toBe(2);
      expect(lock.holdCount).toBe(1);
      expect(await raw.hget(`lock:{${key}}`, owner)).toBe('1');
      expect(await raw.hexists(`lock:{${key}}`, ':handed')).toBe(0);
      // The attempt reset the lease to the waiter's own.
      expect(await raw.pttl(`lock:{${key}}`)).toBeGreaterThan(20_000);
      await lock.release();
      expect(await raw.exists(`lock:{${key}}`)).toBe(0);
    });
  });

  it('never uses a handover that outlived its lease while the waiter was paused (SIGSTOP)', async () => {
    const key = 'fair:stale-handover';
    await raw.del('order');
    const child = new Fixture('fair-waiter', [redis.url, key, String(QUEUE_TIMEOUT)]);
    try {
      await child.next('ready');
      const holder = await app.locks.acquire(key, { fair: true });
      child.send({ type: 'wait', id: 1 });
      await child.next('queued');
      await waitRegistered(raw, key, 'waiter-1');
      child.kill('SIGSTOP');
      const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === key && e.owner !== holder.owner);
      const second = app.locks.acquire(key, { fair: true, waitMs: 30_000 });
      await contended;
      await holder.release();
      // Handed to the paused waiter for the handover lease (the queue timeout, 1 s)...
      expect(await raw.hget(`lock:{${key}}`, 'waiter-1')).toBe('1');
      // ...after which it is free, and the next waiter takes it.
      const lock = await second;
      await raw.rpush('order', 'main');
      child.kill('SIGCONT');
      // The resumed waiter gets the old grant's message; it must queue again, not go in.
      await until(async () => (await raw.lrange(`lock:{${key}}:queue`, 0, -1)).includes('waiter-1') || (await raw.llen('order')) > 1, 10_000, 'the resumed waiter neither queued again nor went in');
      expect(await raw.lrange('order', 0, -1)).toEqual(['main']);
      expect(await raw.hget(`lock:{${key}}`, lock.owner)).toBe('1');
      await lock.release();
      await child.next('granted', (m) => m.id === 1);
      expect(await raw.lrange('order', 0, -1)).toEqual(['main', '1']);
    } finally {
      child.kill('SIGCONT');
      await child.stop();
    }
  });

  /**
   * A lock held in this test's app, and a fair waiter for it in a second app whose queue timeout of
   * 2 s is also its handover lease (it comes back within 1 s of each attempt's start and keeps its
   * place for 2 s after each), registered, with the acquisition `options`; `handedToken()` is the
   * token of the first handover the key's channel carried.
   */
  const waiterBehindHolder = async (key: string, options: { owner?: string } = {}) => {
    const patient = await startLockApp({ redis: redis.url, fairQueueTimeoutMs: 2_000 });
    const listener = raw.duplicate();
    const messages: string[] = [];
    listener.on('message', (_channel: string, message: string) => messages.push(message));
    const close = async () => {
      listener.disconnect();
      await patient.close();
    };
    try {
      await listener.subscribe(`lock:{${key}}`);
      const holder = await app.locks.acquire(key, { fair: true });
      const contended = nextEvent(patient.locks.events$, 'contended', (e) => e.key === key);
      const waiting = patient.locks.acquire(key, { fair: true, waitMs: 30_000, ...options });
      // Its attempt after subscribing registers the wait id; it then sleeps.
      await waitRegistered(raw, key, (await contended).owner);
      const handedToken = async () => {
        let handover: string | undefined;
        await until(async () => (handover = messages.find((m) => m.startsWith('granted '))) !== undefined, 5_000, 'the handover message');
        return Number(handover!.split(' ')[1]);
      };
      return { patient, holder, waiting, handedToken, close };
    } catch (error) {
      await close();
      throw error;
    }
  };

  it('gives back a handover whose message it reads only once the handover lease, counted from its attempt, has ended (a stalled process), and takes the lock afresh', async () => {
    const key = 'fair:stale-message';
    const { holder, waiting, handedToken, close } = await waiterBehindHolder(key);
    try {
      // Redis runs the release (handing the lock to the waiter for 2 s) 1.2 s from now, while this
      // process is stalled for 2.4 s. When it goes on, it reads the handover message before the
      // waiter's timer fires: the grant is older than its handover lease by the waiter's count,
      // though Redis still holds it for the waiter for some 800 ms.
      await raw.client('PAUSE', 1_200, 'ALL');
      const released = holder.release();
      await stallInTimer(2_400);
      await released;
      const lock = await waiting;
      // Given back and taken afresh, with a token past the handover's; using the handover would
      // keep its token.
      const handed = await handedToken();
      expect(handed).toBeGreaterThan(holder.fencingToken);
      expect(lock.fencingToken).toBeGreaterThan(handed);
      expect(await raw.hget(`lock:{${key}}`, lock.owner)).toBe('1');
      await lock.release();
    } finally {
      await close();
    }
  });

  // Before, the give-back dropped one hold but left the handover mark, which named the token only:
  // the retry took the mark for its own handover (hold count 1), and this process's release freed
  // the lock under the other one.
  it('gives back only the handover it read too late when another process joined under the owner token meanwhile, and re-enters that process\'s hold', async () => {
    const key = 'fair:stale-token';
    const joinedFile = join(mkdtempSync(join(tmpdir(), 'token-joiner-')), 'joined');
    const joiner = new Fixture('token-joiner', [redis.url, key, 'shift-9', joinedFile]);
    let close = async () => {};
    try {
      await joiner.next('ready');
      joiner.send({ type: 'watch' });
      await joiner.next('watching');
      // Queued right before the pause below (as in the test above), so its place, 2 s from its
      // latest attempt, outlasts the pause.
      const { holder, waiting, ...rest } = await waiterBehindHolder(key, { owner: 'shift-9' });
      close = rest.close;
      // As in the test above: the release hands the lock to the waiter 1.2 s from now, and this
      // process reads the message at 2.4 s at the earliest, past the handover lease by its count.
      // Meanwhile the child process joins under the token as soon as the handover shows in Redis;
      // this process stays stalled until the child's file says it has.
      await raw.client('PAUSE', 1_200, 'ALL');
      const released = holder.release();
      await stallInTimer(2_400, () => {
        const giveUp = performance.now() + 10_000;
        while (!existsSync(joinedFile) && performance.now() < giveUp);
      });
      await released;
      const lock = await waiting;
      expect((await joiner.next('joined')).holdCount).toBe(2);
      // The handover's hold was given back and the retry re-entered the child's.
      expect(lock.holdCount).toBe(2);
      expect(await raw.hget(`lock:{${key}}`, 'shift-9')).toBe('2');
      await lock.release();
      expect(await raw.hget(`lock:{${key}}`, 'shift-9')).toBe('1');
      joiner.send({ type: 'release' });
      await joiner.next('done');
      expect(await raw.exists(`lock:{${key}}`)).toBe(0);
    } finally {
      await joiner.stop();
      await close();
      rmSync(dirname(joinedFile), { recursive: true, force: true });
    }
  });

  it('comes back at once after an attempt Redis answered late, so a lock handed over next is counted from a fresh attempt and used', async () => {
    const key = 'fair:late-reply';
    const { patient, holder, waiting, handedToken, close } = await waiterBehindHolder(key);
    try {
      await until(async () => asleep(patient, key) === 1, 5_000, 'the waiter asleep');
      const losses: string[] = [];
      const watching = patient.locks.events$.subscribe((e) => e.type === 'lost' && losses.push(e.reason));
      // Its next attempt, about 1 s from now, waits out a 3 s pause: it starts some 2 s before
      // its reply. Had it slept 1 s from that reply, the release 3.4 s from now would hand it the
      // lock 2.4 s after that attempt's start, past the handover lease by its count: it would give
      // the lock back and take it afresh, with a token past the handover's.
      const from = await redisNowMs(raw);
      await raw.client('PAUSE', 3_000, 'ALL');
      await until(async () => (await redisNowMs(raw)) > from + 3_400, 10_000, '3.4 s of Redis time');
      await holder.release();
      const lock = await waiting;
      const handed = await handedToken();
      expect(handed).toBeGreaterThan(holder.fencingToken);
      expect(lock.fencingToken).toBe(handed);
      expect(lock.signal.aborted).toBe(false);
      await lock.release();
      watching.unsubscribe();
      expect(losses).toEqual([]);
    } finally {
      await close();
    }
  });

  it('wakes the next waiter when the head leaves the queue of a free lock', async () => {
    // A queue timeout of 20 s: the waiter below would otherwise sleep up to 10 s between attempts.
    const patient = await startLockApp({ redis: redis.url, fairQueueTimeoutMs: 20_000 });
    try {
      const key = 'fair:leave';
      const holder = await patient.locks.acquire(key, { fair: true });
      const contended = nextEvent(patient.locks.events$, 'contended', (e) => e.key === key);
      const second = patient.locks.acquire(key, { fair: true, waitMs: 60_000 });
      await contended;
      // A waiter ahead of it that will never come back for the lock (a process about to give up).
      await raw.lpush(`lock:{${key}}:queue`, 'ghost');
      await raw.zadd(`lock:{${key}}:queue:timeouts`, Date.now() + 60_000, 'ghost');
      await holder.release(); // hands the lock to 'ghost', which nobody answers
      expect(await raw.hget(`lock:{${key}}`, ':handed')).toBe(' ghost'); // no wait id registered
      const store = (patient.locks as unknown as { store: { abandon(k: string, o: string, m: 'exclusive', fair: boolean): Promise<void> } }).store;
      const leftAt = performance.now();
      // Leaving gives back what was handed to it after it gave up, and the next waiter gets it.
      await store.abandon(key, 'ghost', 'exclusive', true);
      const lock = await second;
      expect(performance.now() - leftAt).toBeLessThan(1_000);
      await lock.release();
    } finally {
      await patient.close();
    }
  });
});
