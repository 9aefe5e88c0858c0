import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Redis } from 'ioredis';
import { LockBackendError, LockNotAcquiredError } from '../../lib/index.js';
import { aborted, asleep, lockEachWay, nextEvent, nextEvents, startLockApp, waitRegistered, type LockApp } from '../support/lock-testing.js';
import { RedisServer, until } from '../support/redis-server.js';

// Teams often share one ioredis client whose own `keyPrefix` option namespaces the app's keys.
// ioredis prefixes the KEYS of every command (EVALSHA's included) but not pub/sub channels: every
// name nestjs-locked writes must then carry the client's prefix, and release messages must still
// reach the waiters.

/**
 * `holder` (held with a 120 s lease) is freed by `free`, while `waiter` waits for `key` with a 120 s
 * wait, asleep: only the message that goes with the release (or force-unlock) can wake it within
 * nextEvent's 10 s. Resolves once the waiter got the lock, and released it.
 */
async function wokenBy(free: () => Promise<unknown>, waiter: LockApp, key: string): Promise<void> {
  const waiting = waiter.locks.acquire(key, { waitMs: 120_000 });
  await until(async () => asleep(waiter, key) === 1, 10_000, 'the waiter asleep');
  const acquired = nextEvent(waiter.locks.events$, 'acquired', (e) => e.key === key);
  await free();
  await acquired;
  const lock = await waiting;
  expect(lock.holdCount).toBe(1);
  await lock.release();
}

describe("a client with ioredis's own keyPrefix", () => {
  let redis: RedisServer;
  let raw: Redis;
  const apps: LockApp[] = [];
  const clients: Redis[] = [];
  let passed: LockApp;
  let built: LockApp;

  beforeAll(async () => {
    redis = await RedisServer.start();
    raw = redis.shared();
    const client = new Redis(redis.port, '127.0.0.1', { keyPrefix: 'app:' });
    clients.push(client);
    passed = await startLockApp({ redis: client });
    // The same prefix given as ioredis options: the module makes its own connection with it.
    built = await startLockApp({ redis: { host: '127.0.0.1', port: redis.port, keyPrefix: 'app:' } });
    apps.push(passed, built);
  });
  afterAll(async () => {
    for (const app of apps) await app.close();
    for (const client of clients) await client.quit();
    await redis?.stop();
  });

  /** Every key in Redis but the fencing counters, which stay for their lifetime. */
  const locksInRedis = async () => (await raw.keys('*')).filter((k) => !k.endsWith(':fence')).sort();

  it('writes every name under the prefix and leaves nothing behind, each way a lock is taken', async () => {
    const held = await passed.locks.acquire('p:held');
    const group = await passed.locks.acquire(['p:g1', 'p:g2']);
    const read = await passed.locks.readLock('p:read');
    expect(await raw.keys('*')).toEqual(expect.arrayContaining(['app:lock:{p:held}', 'app:lock:{p:held}:fence', 'app:lock:{p:g1}', 'app:lock:{p:g2}', 'app:lock:{p:read}']));
    expect((await raw.keys('*')).filter((k) => !k.startsWith('app:'))).toEqual([]);
    // What LockService reads goes through the same prefix.
    expect(await built.locks.isLocked('p:held')).toBe(true);
    expect(await built.locks.remainingTtl('p:held')).toBeGreaterThan(0);
    expect(await built.locks.holdCount('p:held', { owner: held.owner })).toBe(1);
    await expect(built.locks.acquire('p:g2', { waitMs: 0 })).rejects.toBeInstanceOf(LockNotAcquiredError);
    // A connection without that prefix locks other names: the same key is free there.
    const unprefixed = await startLockApp({ redis: redis.url });
    apps.push(unprefixed);
    await (await unprefixed.locks.acquire('p:held', { waitMs: 0 })).release();
    await Promise.all([held.release(), group.release(), read.release()]);

    await lockEachWay(passed.locks, 'p:each');
    await lockEachWay(built.locks, 'b:each');
    expect(await locksInRedis()).toEqual([]);
    // Outside the prefix, only the unprefixed connection's fencing counter.
    expect((await raw.keys('*')).filter((k) => !k.startsWith('app:'))).toEqual(['lock:{p:held}:fence']);
  });

  it('wakes a waiter of another process with the release message', async () => {
    const holder = await passed.locks.acquire('p:wake', { leaseMs: 120_000 });
    await wokenBy(() => holder.release(), built, 'p:wake');
  });

  it('hands a fair lock to the queued waiter of another process', async () => {
    const holder = await built.locks.acquire('p:fair', { fair: true });
    const waiting = passed.locks.acquire('p:fair', { fair: true, waitMs: 10_000 });
    await until(async () => (await raw.llen('app:lock:{p:fair}:queue')) === 1, 10_000, 'the fair waiter queued');
    const owner = (await raw.lindex('app:lock:{p:fair}:queue', 0))!;
    await waitRegistered({ hget: (key, field) => raw.hget(`app:${key}`, field) }, 'p:fair', owner);
    await holder.release();
    const lock = await waiting;
    expect(lock.owner).toBe(owner);
    await lock.release();
    expect(await locksInRedis()).toEqual([]);
  });

  it('renews through the prefix: a 1.5 s lease stays held across renewals', async () => {
    const renewed = nextEvents(passed.locks.events$, 'renewed', 3);
    const held = await passed.locks.acquire('p:renew', { leaseMs: 1_500, watchdog: true });
    await renewed;
    expect(held.signal.aborted).toBe(false);
    expect(await raw.pttl('app:lock:{p:renew}')).toBeGreaterThan(0);
    await held.release();
  });

  it('force-unlocks through the prefix from another process: its waiter is woken, the holder told at its next renewal', async () => {
    const fixed = await passed.locks.acquire('p:force', { leaseMs: 120_000 });
    await wokenBy(async () => expect(await built.locks.forceUnlock('p:force')).toBe(true), built, 'p:force');
    await fixed.release();

    const held = await passed.locks.acquire('p:force', { leaseMs: 1_500, watchdog: true });
    expect(await built.locks.forceUnlock('p:force')).toBe(true);
    expect(await aborted(held.signal)).toMatchObject({ reason: 'taken' });
    expect(await locksInRedis()).toEqual([]);
  });
});

// ioredis's `db` option selects a logical database: lock names live there, while pub/sub channels
// are shared by every database of the server.
describe("a client with ioredis's db option", () => {
  let redis: RedisServer;
  let raw: Redis;
  const apps: LockApp[] = [];
  let db2: LockApp;
  let db2Too: LockApp;
  let db0: LockApp;
  let inDb2: Redis;

  beforeAll(async () => {
    redis = await RedisServer.start();
    raw = redis.shared();
    db2 = await startLockApp({ redis: { host: '127.0.0.1', port: redis.port, db: 2 } });
    db2Too = await startLockApp({ redis: `redis://127.0.0.1:${redis.port}/2` });
    db0 = await startLockApp({ redis: redis.url });
    apps.push(db2, db2Too, db0);
    inDb2 = new Redis(redis.port, '127.0.0.1', { db: 2 });
  });
  afterAll(async () => {
    for (const app of apps) await app.close();
    await inDb2?.quit();
    await redis?.stop();
  });

  it('keeps its locks in that database: the same key is held there and free in another', async () => {
    const held = await db2.locks.acquire('d:one', { leaseMs: 120_000 });
    expect(await raw.exists('lock:{d:one}')).toBe(0);
    expect(await inDb2.hgetall('lock:{d:one}')).toEqual({ [held.owner]: '1' });
    await expect(db2Too.locks.acquire('d:one', { waitMs: 0 })).rejects.toBeInstanceOf(LockNotAcquiredError);
    await (await db0.locks.acquire('d:one', { waitMs: 0 })).release();

    // A waiter in the same database is woken by the release message.
    await wokenBy(() => held.release(), db2Too, 'd:one');
    await lockEachWay(db2.locks, 'd:each');
    expect((await inDb2.keys('*')).filter((k) => !k.endsWith(':fence'))).toEqual([]);
  });
});

// ioredis's enableAutoPipelining, common on a shared client, sends the commands of one tick as a
// pipeline: nestjs-locked's scripts go through it too.
describe("a client with ioredis's enableAutoPipelining", () => {
  let redis: RedisServer;
  let raw: Redis;
  let client: Redis;
  const apps: LockApp[] = [];
  let app: LockApp;
  let other: LockApp;

  beforeAll(async () => {
    redis = await RedisServer.start();
    raw = redis.shared();
    client = new Redis(redis.port, '127.0.0.1', { enableAutoPipelining: true });
    app = await startLockApp({ redis: client });
    other = await startLockApp({ redis: { host: '127.0.0.1', port: redis.port, enableAutoPipelining: true } });
    apps.push(app, other);
  });
  afterAll(async () => {
    for (const a of apps) await a.close();
    await client?.quit();
    await redis?.stop();
  });

  it('takes and releases each way, and serves 20 concurrent callers of one key in turn, each alone', async () => {
    await lockEachWay(app.locks, 'ap:each');
    let inside = 0;
    let most = 0;
    const served: string[] = [];
    await Promise.all(
      Array.from({ length: 20 }, (_, i) =>
        (i % 2 ? app : other).locks.run('ap:one', async () => {
          most = Math.max(most, ++inside);
          await new Promise<void>((resolve) => setImmediate(resolve));
          served.push(String(i));
          inside--;
        }),
      ),
    );
    expect(most).toBe(1);
    expect(served).toHaveLength(20);
    // Also many keys at once, in the same ticks (one pipeline).
    const acquiring = Array.from({ length: 50 }, (_, i) => app.locks.acquire(`ap:many:${i}`));
    // Queued for ioredis's next pipeline, not sent on their own.
    expect(client.autoPipelineQueueSize).toBe(50);
    const handles = await Promise.all(acquiring);
    expect(new Set(handles.map((h) => h.fencingToken)).size).toBe(50);
    await Promise.all(handles.map((h) => h.release()));
    expect((await raw.keys('*')).filter((k) => !k.endsWith(':fence'))).toEqual([]);
  });

  it('wakes a waiter of another process with the release message, and hands a fair lock over', async () => {
    const holder = await app.locks.acquire('ap:wake', { leaseMs: 120_000 });
    await wokenBy(() => holder.release(), other, 'ap:wake');

    const fairHolder = await other.locks.acquire('ap:fair', { fair: true });
    const fairWaiting = app.locks.acquire('ap:fair', { fair: true, waitMs: 10_000 });
    await until(async () => (await raw.llen('lock:{ap:fair}:queue')) === 1, 10_000, 'the fair waiter queued');
    const owner = (await raw.lindex('lock:{ap:fair}:queue', 0))!;
    await waitRegistered(raw, 'ap:fair', owner);
    await fairHolder.release();
    const handed = await fairWaiting;
    expect(handed.owner).toBe(owner);
    await handed.release();
  });

  it('sends a script again in full after Redis forgot it (SCRIPT FLUSH), several in one pipeline', async () => {
    await raw.script('FLUSH');
    const acquiring = Array.from({ length: 10 }, (_, i) => app.locks.acquire(`ap:flush:${i}`));
    expect(client.autoPipelineQueueSize).toBe(10);
    const handles = await Promise.all(acquiring);
    expect(handles.every((h) => h.holdCount === 1)).toBe(true);
    await raw.script('FLUSH');
    await Promise.all(handles.map((h) => h.release()));
    expect(await raw.exists(...handles.map((h) => `lock:{${h.key}}`))).toBe(0);
  });
});

// BullMQ asks for maxRetriesPerRequest: null on its connections, so teams that share one with
// nestjs-locked have commands that wait in ioredis's offline queue for as long as Redis is away,
// instead of failing after a few reconnection attempts.
describe('a client with maxRetriesPerRequest: null (as BullMQ sets it) while Redis is down', () => {
  let redis: RedisServer;
  let client: Redis;
  let app: LockApp;

  beforeAll(async () => {
    redis = await RedisServer.start();
    client = new Redis(redis.port, '127.0.0.1', { maxRetriesPerRequest: null, enableReadyCheck: false, retryStrategy: () => 50 });
    app = await startLockApp({ redis: client, leaseMs: 1_500 });
  });
  afterAll(async () => {
    await app?.close();
    client?.disconnect();
    await redis?.stop();
  });

  it('reports the held lock lost at its deadline, bounds an acquisition, and leaves no lock behind once Redis is back', async () => {
    const held = await app.locks.acquire('bq:held');
    await redis.kill();
    // Renewals wait in the offline queue: the lease deadline, on this process's clock, ends the lock.
    expect(await aborted(held.signal)).toMatchObject({ reason: 'lease-expired' });
    // The attempt is bounded (at least 1 s) although its command waits in the queue.
    await expect(app.locks.acquire('bq:new', { waitMs: 200 })).rejects.toBeInstanceOf(LockBackendError);

    await redis.launch();
    // The queued commands run in order once the client is back: the abandoned attempt is granted
    // then, and given back as soon as its reply comes. Two round trips on the same connection
    // come after that reply and after the give-back.
    await client.ping();
    await client.ping();
    expect((await redis.shared().keys('*')).filter((k) => !k.endsWith(':fence'))).toEqual([]);
    const lock = await app.locks.acquire('bq:new', { waitMs: 0 });
    expect(lock.holdCount).toBe(1);
    await lock.release();
    await held.release(); // a no-op once lost
    expect((await redis.shared().keys('*')).filter((k) => !k.endsWith(':fence'))).toEqual([]);
  });
});

describe("a client with ioredis's lazyConnect, not connected yet", () => {
  let redis: RedisServer;
  const clients: Redis[] = [];
  const apps: LockApp[] = [];

  beforeAll(async () => {
    redis = await RedisServer.start();
  });
  afterAll(async () => {
    for (const app of apps) await app.close();
    for (const client of clients) await client.quit();
    await redis?.stop();
  });

  it.each([
    ['checked at bootstrap', {}],
    ['not checked (connectTimeoutMs: 0)', { connectTimeoutMs: 0 }],
  ])('connects it at bootstrap, %s', async (_name, options) => {
    const client = new Redis(redis.port, '127.0.0.1', { lazyConnect: true });
    clients.push(client);
    expect(client.status).toBe('wait');
    const app = await startLockApp({ redis: client, ...options });
    apps.push(app);
    expect(client.status).not.toBe('wait');
    const lock = await app.locks.acquire('lazy:1', { waitMs: 0 });
    expect(client.status).toBe('ready');
    expect(await redis.shared().hgetall('lock:{lazy:1}')).toEqual({ [lock.owner]: '1' });
    await lock.release();
  });
});

// enableOfflineQueue: false makes ioredis refuse every command sent while the connection is not
// ready, instead of queueing it: the bootstrap check waits for the connection first, and the
// subscriber connection (nestjs-locked's own) queues its SUBSCRIBE whatever the client says.
describe("a client with ioredis's enableOfflineQueue: false", () => {
  let redis: RedisServer;
  const clients: Redis[] = [];
  const apps: LockApp[] = [];
  let passed: LockApp;
  let built: LockApp;

  beforeAll(async () => {
    redis = await RedisServer.start();
    const client = new Redis(redis.port, '127.0.0.1', { enableOfflineQueue: false });
    clients.push(client);
    passed = await startLockApp({ redis: client });
    built = await startLockApp({ redis: { host: '127.0.0.1', port: redis.port, enableOfflineQueue: false } });
    apps.push(passed, built);
  });
  afterAll(async () => {
    for (const app of apps) await app.close();
    for (const client of clients) await client.quit();
    await redis?.stop();
  });

  it('boots on a client passed in and on options, takes locks each way, and wakes a waiter by message', async () => {
    await lockEachWay(passed.locks, 'eoq:passed');
    await lockEachWay(built.locks, 'eoq:built');
    const holder = await passed.locks.acquire('eoq:wake', { leaseMs: 120_000 });
    await wokenBy(() => holder.release(), built, 'eoq:wake');
    const fixed = await built.locks.acquire('eoq:wake2', { leaseMs: 120_000 });
    await wokenBy(() => fixed.release(), passed, 'eoq:wake2');
    expect((await redis.shared().keys('*')).filter((k) => !k.endsWith(':fence'))).toEqual([]);
  });

  it('fails a lock step at once while Redis is down, with the refusal as its cause, and locks again once it is back', async () => {
    await redis.kill();
    const failure = await passed.locks.acquire('eoq:down', { waitMs: 60_000 }).then(
      () => new Error('acquired'),
      (e: unknown) => e,
    );
    expect(failure).toBeInstanceOf(LockBackendError);
    // ioredis's own refusal, not the attempt's bound (60 s here) running out.
    expect(String((failure as Error & { cause?: unknown }).cause)).toMatch(/Stream isn't writeable and enableOfflineQueue options is false/);
    await redis.launch();
    await until(async () => (await passed.locks.health()).status === 'up', 10_000, 'the client back');
    await (await passed.locks.acquire('eoq:down', { waitMs: 0 })).release();
  });
});
