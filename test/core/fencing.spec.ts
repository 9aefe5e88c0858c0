import { describe, expect, it } from '@jest/globals';
import type { Redis } from 'ioredis';
import { Fixture } from '../support/children.js';
import { FENCED_WRITE } from '../fixtures/fenced-write.js';
import { LockConfigurationError } from '../../lib/index.js';
import { commandCalls, scriptCalls, until, type RedisServer } from '../support/redis-server.js';
import { aborted, asleep, lockEachWay, nextEvent, waitRegistered, usePrivateLockApp, type LockApp } from '../support/lock-testing.js';

/** A fair lock held by one owner, with a second one asleep in its queue (wait id registered). */
async function queued({ locks }: LockApp, raw: Redis, key: string) {
  const holder = await locks.acquire(key, { fair: true });
  const contended = nextEvent(locks.events$, 'contended', (e) => e.key === key);
  const waiter = locks.acquire(key, { fair: true });
  await waitRegistered(raw, key, (await contended).owner);
  return { holder, waiter };
}

describe('fencing tokens', () => {
  let redis: RedisServer;
  let raw: Redis;
  let app: LockApp;
  usePrivateLockApp({}, (started) => ({ redis, raw, app } = started));

  it('strictly increase over 1000 grants shared by 2 processes', async () => {
    const children = [0, 1].map(() => new Fixture('token-grants', [redis.url, 'fence:shared', '500']));
    try {
      await Promise.all(children.map((c) => c.next('ready')));
      for (const c of children) c.send({ type: 'go' });
      await Promise.all(children.map((c) => c.next('done', undefined, 120_000)));
    } finally {
      await Promise.all(children.map((c) => c.stop()));
    }
    const tokens = (await raw.lrange('tokens', 0, -1)).map(Number);
    expect(tokens).toHaveLength(1_000);
    for (let i = 1; i < tokens.length; i++) expect(tokens[i]).toBeGreaterThan(tokens[i - 1]!);
  });

  it('increase across a re-acquire after the lock key expired, and after the counter itself expired', async () => {
    const first = await app.locks.acquire('fence:expiry', { leaseMs: 150 });
    await aborted(first.signal); // the fixed lease ran out
    const second = await app.locks.acquire('fence:expiry');
    expect(second.fencingToken).toBeGreaterThan(first.fencingToken);
    await second.release();
    await raw.del('lock:{fence:expiry}:fence'); // what the counter's own expiry does
    const third = await app.locks.acquire('fence:expiry');
    expect(third.fencingToken).toBeGreaterThan(second.fencingToken);
    await third.release();
  });

  it("are Redis's clock in microseconds on a fresh counter, for single, read and multi-key grants, also when the microseconds have fewer than six digits", async () => {
    const redisTime = async () => {
      const [s, us] = await raw.time();
      return { s: Number(s), us: Number(us), micros: Number(s) * 1_000_000 + Number(us) };
    };
    // TIME's microseconds have fewer than six digits in the first tenth of each second: grant on
    // fresh keys until three rounds fell wholly inside that tenth and three outside it (about a second).
    let short = 0;
    let long = 0;
    for (let i = 0; short < 3 || long < 3; i++) {
      expect(i).toBeLessThan(10_000);
      const before = await redisTime();
      const single = await app.locks.acquire(`fence:clock:x${i}`);
      const read = await app.locks.readLock(`fence:clock:r${i}`);
      const group = await app.locks.acquire([`fence:clock:g${i}`, `fence:clock:h${i}`]);
      const after = await redisTime();
      for (const token of [single.fencingToken, read.fencingToken, ...group.handles.map((h) => h.fencingToken)]) {
        expect(token).toBeGreaterThanOrEqual(before.micros);
        expect(token).toBeLessThanOrEqual(after.micros);
      }
      if (before.s === after.s && after.us < 100_000) short++;
      else if (before.us >= 100_000) long++;
      await Promise.all([single.release(), read.release(), group.release()]);
    }
  });

  it('keep increasing while the counter is ahead of the server clock (a clock stepped back), for single, read and multi-key grants', async () => {
    // A counter 10^15 microseconds (about 31 years) ahead of Redis's clock: the clock-seeded
    // token alone would go backwards, so every grant must continue from the counter.
    const ahead = 3_000_000_000_000_000;
    for (const key of ['fence:ahead:x', 'fence:ahead:r', 'fence:ahead:g1', 'fence:ahead:g2']) await raw.set(`lock:{${key}}:fence`, String(ahead), 'PX', 60_000);
    const single = await app.locks.acquire('fence:ahead:x');
    expect(single.fencingToken).toBe(ahead + 1);
    await single.release();
    const again = await app.locks.acquire('fence:ahead:x');
    expect(again.fencingToken).toBe(ahead + 2);
    await again.release();
    const read = await app.locks.readLock('fence:ahead:r');
    expect(read.fencingToken).toBe(ahead + 1);
    await read.release();
    const group = await app.locks.acquire(['fence:ahead:g1', 'fence:ahead:g2']);
    expect(group.handles.map((h) => h.fencingToken)).toEqual([ahead + 1, ahead + 1]);
    await group.release();
    // The counter keeps its idle lifetime after every grant.
    expect(await raw.pttl('lock:{fence:ahead:x}:fence')).toBeGreaterThan(60_000);
  });

  it('let the resource reject a holder paused past its lease (SIGSTOP) and accept the newer holder', async () => {
    const stale = new Fixture('fenced-holder', [redis.url, 'fence:paused', '600']);
    try {
      const { token: staleToken } = (await stale.next('holding')) as unknown as { token: number };
      process.kill(stale.pid, 'SIGSTOP');
      // The paused holder cannot renew; its lease runs out and we get the lock.
      const newer = await app.locks.acquire('fence:paused', { waitMs: 10_000 });
      expect(newer.fencingToken).toBeGreaterThan(staleToken);
      expect(await raw.eval(FENCED_WRITE, 1, 'resource', String(newer.fencingToken), 'from-newer-holder')).toBe(1);
      process.kill(stale.pid, 'SIGCONT');
      stale.send({ type: 'write' });
      const wrote = (await stale.next('wrote')) as unknown as { accepted: boolean; signalAborted: boolean };
      expect(wrote.accepted).toBe(false);
      expect(wrote.signalAborted).toBe(true);
      expect(await raw.hget('resource', 'value')).toBe('from-newer-holder');
      await newer.release();
    } finally {
      await stale.stop();
    }
  });

  it('leave only their counter in Redis after a release, for an hour: plain, re-entered, read, write, multi-key and fair handed-over locks', async () => {
    const keys = await lockEachWay(app.locks, 'left');
    // Asleep with its wait id registered: the release hands it the lock (hash field `:handed`).
    const { holder, waiter } = await queued(app, raw, 'left:fair');
    await holder.release();
    await (await waiter).release();
    for (const key of [...keys, 'left:fair']) {
      expect((await raw.keys(`lock:{${key}}*`)).sort()).toEqual([`lock:{${key}}:fence`]);
      const ttl = await raw.pttl(`lock:{${key}}:fence`);
      expect(ttl).toBeGreaterThan(3_500_000);
      expect(ttl).toBeLessThanOrEqual(3_600_000);
    }
  });
});

describe('fencing tokens across a Redis restart without persistence', () => {
  let redis: RedisServer;
  let app: LockApp;
  usePrivateLockApp({}, (started) => ({ redis, app } = started));

  it('keep increasing after redis-server was killed and started again empty, for single, read and multi-key grants', async () => {
    const before = [
      await app.locks.run('fence:restart', async (l) => l.fencingToken),
      await app.locks.run('fence:restart:read', async (l) => l.fencingToken, { mode: 'read' }),
      ...(await app.locks.run(['fence:restart:a', 'fence:restart:b'], async (g) => Object.values(g.fencingTokens))),
    ];
    await redis.kill(); // SIGKILL: nothing saved, so every counter is gone
    await redis.launch();
    expect(await redis.client().dbsize()).toBe(0);
    const after = [
      await app.locks.run('fence:restart', async (l) => l.fencingToken),
      await app.locks.run('fence:restart:read', async (l) => l.fencingToken, { mode: 'read' }),
      ...(await app.locks.run(['fence:restart:a', 'fence:restart:b'], async (g) => Object.values(g.fencingTokens))),
    ];
    for (const [i, token] of after.entries()) expect(token).toBeGreaterThan(before[i]!);
  });
});

describe('fencing counters with fencingCounterTtlMs', () => {
  const COUNTER_TTL = 2_000;
  let raw: Redis;
  let app: LockApp;
  usePrivateLockApp({ fencingCounterTtlMs: COUNTER_TTL, fairQueueTimeoutMs: 20_000 }, (started) => ({ raw, app } = started));

  it('keeps each counter that long after its grant (plain, read, write, multi-key, and fair locks handed over by a release or a force-unlock), and tokens still increase once it expired', async () => {
    const { locks } = app;
    const keys = await lockEachWay(locks, 'ttl');
    const plain = await locks.acquire('ttl:plain');
    const plainToken = plain.fencingToken;
    await plain.release();
    const released = await queued(app, raw, 'ttl:fair-released');
    await released.holder.release(); // handed to the waiter inside the release script
    await (await released.waiter).release();
    const forced = await queued(app, raw, 'ttl:fair-forced');
    expect(await locks.forceUnlock('ttl:fair-forced')).toBe(true); // handed to the waiter inside the force-unlock script
    const forcedHandle = await forced.waiter;
    expect(forcedHandle.fencingToken).toBeGreaterThan(forced.holder.fencingToken);
    await forcedHandle.release();
    for (const key of [...keys, 'ttl:fair-released', 'ttl:fair-forced']) {
      const ttl = await raw.pttl(`lock:{${key}}:fence`);
      expect(ttl).toBeGreaterThan(0);
      expect(ttl).toBeLessThanOrEqual(COUNTER_TTL);
    }
    // The counter's own expiry, for real (Redis announces none: poll it).
    await until(async () => (await raw.exists('lock:{ttl:plain}:fence')) === 0, 3 * COUNTER_TTL, 'the counter never expired');
    const after = await locks.acquire('ttl:plain');
    expect(after.fencingToken).toBeGreaterThan(plainToken);
    await after.release();
  });
});

describe('fencingTokens: false', () => {
  let raw: Redis;
  let app: LockApp;
  usePrivateLockApp({ fencingTokens: false, fairQueueTimeoutMs: 20_000 }, (started) => ({ raw, app } = started));

  it('grants carry no token, read neither the clock nor a counter, and leave nothing in Redis (plain, re-entered, read, write, multi-key)', async () => {
    const { locks } = app;
    await raw.config('RESETSTAT');
    const acquired = nextEvent(locks.events$, 'acquired', (e) => e.key === 'off:event');
    const lock = await locks.acquire('off:event');
    expect(() => lock.fencingToken).toThrow(LockConfigurationError);
    expect(() => lock.fencingToken).toThrow(/fencingTokens is false in the LockModule options/);
    expect((await acquired).fencingToken).toBeNaN();
    await lock.release();
    const keys = await lockEachWay(locks, 'off');
    const group = await locks.acquire(['off:g1', 'off:g2']);
    expect(() => group.fencingTokens).toThrow(LockConfigurationError);
    await group.release();
    // The one TIME is the read grant's: waiting writers' places lapse on Redis's clock.
    const calls = await commandCalls(raw, 'time', 'set', 'get', 'evalsha');
    expect(calls).toEqual({ time: 1, set: 0, get: 0, evalsha: expect.any(Number) });
    expect(calls.evalsha).toBeGreaterThanOrEqual(2 * (keys.length + 2));
    expect(await raw.keys('lock:*')).toEqual([]);
  });

  it('fair locks still hand over inside the release (their counters stay: the handover needs them)', async () => {
    const { holder, waiter } = await queued(app, raw, 'off:fair');
    await raw.config('RESETSTAT');
    await holder.release();
    const lock = await waiter;
    // One script ran: the holder's release. The waiter took the lock without asking.
    expect(await scriptCalls(raw)).toBe(1);
    expect(() => lock.fencingToken).toThrow(LockConfigurationError);
    await lock.release();
    expect(await raw.keys('lock:*')).toEqual(['lock:{off:fair}:fence']);
  });

  it('a release hands a waiter of its process the lock with no token, no clock read and no counter', async () => {
    const key = 'off:along';
    const holder = await app.locks.acquire(key);
    const waiting = app.locks.acquire(key, { waitMs: 30_000 });
    await until(async () => asleep(app, key) === 1, 10_000, 'the waiter asleep');
    await raw.config('RESETSTAT');
    await holder.release();
    const lock = await waiting;
    // One script ran, the release, and it read no clock and set no counter.
    expect(await commandCalls(raw, 'time', 'set', 'evalsha')).toEqual({ time: 0, set: 0, evalsha: 1 });
    expect(() => lock.fencingToken).toThrow(LockConfigurationError);
    expect(await raw.hgetall(`lock:{${key}}`)).toEqual({ [lock.owner]: '1' });
    await lock.release();
    expect(await raw.keys(`lock:{${key}}*`)).toEqual([]);
  });
});
