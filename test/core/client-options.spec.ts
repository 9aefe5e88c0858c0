import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { Redis, type RedisOptions } from 'ioredis';
import { LockBackendError, LockNotAcquiredError, LockQuorumError, type LockModuleOptions } from '../../lib/index.js';
import { aborted, lockEachWay, nextEvents, startLockApp, waitRegistered, within, wokenBy, type LockApp } from '../support/lock-testing.js';
import { RedisServer, until } from '../support/redis-server.js';
import { RedisCluster } from '../support/redis-cluster.js';
import { keySlot } from '../../lib/store/redis/redis-lock.store.js';

// The ioredis options a team may have set on a client it shares with nestjs-locked (README,
// "Sharing an ioredis client"), each with a private redis-server.

/**
 * For one describe block: a private redis-server, started before its tests, and the apps and
 * clients they start on it, closed after them (the apps first); then the server is stopped. Jest
 * runs the block's own hooks declared after this call once the server is up.
 */
function usePrivateServer() {
  let redis: RedisServer | undefined;
  const apps: LockApp[] = [];
  const clients: Redis[] = [];
  beforeAll(async () => {
    redis = await RedisServer.start();
  });
  afterAll(async () => {
    for (const app of apps.splice(0)) await app.close();
    for (const client of clients.splice(0)) client.disconnect();
    await redis?.stop();
  });
  return {
    get redis(): RedisServer {
      return redis!;
    },
    /** A client of the application's, with its own ioredis options. */
    client(options: RedisOptions): Redis {
      const client = new Redis(redis!.port, '127.0.0.1', options);
      clients.push(client);
      return client;
    },
    async app(options: LockModuleOptions): Promise<LockApp> {
      const app = await startLockApp(options);
      apps.push(app);
      return app;
    },
    /** Two applications with the same ioredis options: on a client passed in, made with them, and given them as options. */
    async pair(options: RedisOptions): Promise<{ raw: Redis; passed: LockApp; built: LockApp }> {
      const passed = await this.app({ redis: this.client(options) });
      const built = await this.app({ redis: { host: '127.0.0.1', port: redis!.port, ...options } });
      return { raw: redis!.shared(), passed, built };
    },
  };
}

/** Every key in Redis but the fencing counters, which stay for their lifetime after a release. */
async function locksIn(client: Redis): Promise<string[]> {
  return (await client.keys('*')).filter((k) => !k.endsWith(':fence')).sort();
}

/**
 * `holderApp` holds `key` in fair mode while a fair waiter of `waiterApp` queues and registers; the
 * release hands the lock to that waiter. `prefix`: the ioredis keyPrefix of the names in `raw`'s view.
 */
/** A watchdog lock with a lease of `leaseMs` stays held across 3 renewals, its Redis name (`name`) still there. */
async function staysHeldAcrossRenewals(app: LockApp, key: string, leaseMs: number, raw: Redis, name: string): Promise<void> {
  const renewed = nextEvents(app.locks.events$, 'renewed', 3);
  const held = await app.locks.acquire(key, { leaseMs, watchdog: true });
  await renewed;
  expect(held.signal.aborted).toBe(false);
  expect(await raw.pttl(name)).toBeGreaterThan(0);
  await held.release();
}

async function fairHandover(holderApp: LockApp, waiterApp: LockApp, key: string, raw: Redis, prefix = ''): Promise<void> {
  const holder = await holderApp.locks.acquire(key, { fair: true });
  const waiting = waiterApp.locks.acquire(key, { fair: true, waitMs: 10_000 });
  const queue = `${prefix}lock:{${key}}:queue`;
  await until(async () => (await raw.llen(queue)) === 1, 10_000, 'the fair waiter queued');
  const owner = (await raw.lindex(queue, 0))!;
  await waitRegistered({ hget: (name, field) => raw.hget(`${prefix}${name}`, field) }, key, owner);
  await holder.release();
  const lock = await waiting;
  expect(lock.owner).toBe(owner);
  await lock.release();
}

/**
 * `app` tries `key` once (waitMs 0) while `held` (the server, the master that serves the key, or
 * Redlock nodes) hold every write, until the attempt failed with `failsWith`; then they run it.
 * Resolves to the failure once no lock of a late grant is left on `nodes` (default: `held`).
 */
async function attemptHeldUp(
  app: LockApp,
  key: string,
  held: readonly Redis[],
  failsWith: abstract new (...args: never[]) => Error = LockBackendError,
  nodes: readonly Redis[] = held,
): Promise<Error & { cause?: unknown }> {
  for (const node of held) await node.client('PAUSE', 60_000, 'WRITE');
  let failure: unknown;
  try {
    failure = await app.locks.acquire(key, { waitMs: 0 }).then(() => new Error('acquired'), (e: unknown) => e);
  } finally {
    for (const node of held) await node.client('UNPAUSE');
  }
  expect(failure).toBeInstanceOf(failsWith);
  await until(async () => (await Promise.all(nodes.map((node) => node.exists(`lock:{${key}}`)))).every((n) => n === 0), 10_000, `the late grants of ${key} given back`);
  return failure as Error & { cause?: unknown };
}

// ioredis prefixes the KEYS of every command (EVALSHA's included) but not pub/sub channels: every
// name nestjs-locked writes must then carry the client's prefix, and release messages must still
// reach the waiters.
describe("a client with ioredis's own keyPrefix", () => {
  const server = usePrivateServer();
  let raw: Redis;
  let passed: LockApp;
  let built: LockApp;

  beforeAll(async () => {
    // The same prefix given as ioredis options too: the module makes its own connection with it.
    ({ raw, passed, built } = await server.pair({ keyPrefix: 'app:' }));
  });

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
    const unprefixed = await server.app({ redis: server.redis.url });
    await (await unprefixed.locks.acquire('p:held', { waitMs: 0 })).release();
    await Promise.all([held.release(), group.release(), read.release()]);

    await lockEachWay(passed.locks, 'p:each');
    await lockEachWay(built.locks, 'b:each');
    expect(await locksIn(raw)).toEqual([]);
    // Outside the prefix, only the unprefixed connection's fencing counter.
    expect((await raw.keys('*')).filter((k) => !k.startsWith('app:'))).toEqual(['lock:{p:held}:fence']);
  });

  it('wakes a waiter of another process with the release message', async () => {
    const holder = await passed.locks.acquire('p:wake', { leaseMs: 120_000 });
    await wokenBy(() => holder.release(), built, 'p:wake');
  });

  it('hands a fair lock to the queued waiter of another process', async () => {
    await fairHandover(built, passed, 'p:fair', raw, 'app:');
    expect(await locksIn(raw)).toEqual([]);
  });

  it('renews through the prefix: a 1.5 s lease stays held across renewals', async () => {
    await staysHeldAcrossRenewals(passed, 'p:renew', 1_500, raw, 'app:lock:{p:renew}');
  });

  it('force-unlocks through the prefix from another process: its waiter is woken, the holder told at its next renewal', async () => {
    const fixed = await passed.locks.acquire('p:force', { leaseMs: 120_000 });
    await wokenBy(async () => expect(await built.locks.forceUnlock('p:force')).toBe(true), built, 'p:force');
    await fixed.release();

    const held = await passed.locks.acquire('p:force', { leaseMs: 1_500, watchdog: true });
    expect(await built.locks.forceUnlock('p:force')).toBe(true);
    expect(await aborted(held.signal)).toMatchObject({ reason: 'taken' });
    expect(await locksIn(raw)).toEqual([]);
  });
});

// ioredis's `db` option selects a logical database: lock names live there, while pub/sub channels
// are shared by every database of the server.
describe("a client with ioredis's db option", () => {
  const server = usePrivateServer();
  let db2: LockApp;
  let db2Too: LockApp;
  let db0: LockApp;
  let inDb2: Redis;

  beforeAll(async () => {
    db2 = await server.app({ redis: { host: '127.0.0.1', port: server.redis.port, db: 2 } });
    db2Too = await server.app({ redis: `redis://127.0.0.1:${server.redis.port}/2` });
    db0 = await server.app({ redis: server.redis.url });
    inDb2 = server.client({ db: 2 });
  });

  it('keeps its locks in that database: the same key is held there and free in another', async () => {
    const held = await db2.locks.acquire('d:one', { leaseMs: 120_000 });
    expect(await server.redis.shared().exists('lock:{d:one}')).toBe(0);
    expect(await inDb2.hgetall('lock:{d:one}')).toEqual({ [held.owner]: '1' });
    await expect(db2Too.locks.acquire('d:one', { waitMs: 0 })).rejects.toBeInstanceOf(LockNotAcquiredError);
    await (await db0.locks.acquire('d:one', { waitMs: 0 })).release();

    // A waiter in the same database is woken by the release message.
    await wokenBy(() => held.release(), db2Too, 'd:one');
    await lockEachWay(db2.locks, 'd:each');
    expect(await locksIn(inDb2)).toEqual([]);
  });
});

// A Redis on the same host, reached over its Unix socket (ioredis's path option): no host or port.
describe('a connection over a Unix socket (ioredis path option)', () => {
  let redis: RedisServer;
  let dir: string;
  let socket: string;
  const apps: LockApp[] = [];
  const clients: Redis[] = [];
  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), 'nestjs-locked-socket-'));
    socket = join(dir, 'redis.sock');
    redis = await RedisServer.start(['--unixsocket', socket, '--unixsocketperm', '700']);
  });
  afterAll(async () => {
    for (const app of apps.splice(0)) await app.close();
    for (const client of clients.splice(0)) client.disconnect();
    await redis?.stop();
    await rm(dir, { recursive: true, force: true });
  });

  it('takes locks each way on options and on a client passed in, wakes a waiter of the other app by message, and leaves nothing behind', async () => {
    const onOptions = await startLockApp({ redis: { path: socket } });
    apps.push(onOptions);
    const client = new Redis({ path: socket });
    clients.push(client);
    const onClient = await startLockApp({ redis: client });
    apps.push(onClient);
    const shared = redis.shared();
    // Every connection of both apps (the waiter's subscriber too) is on the socket: none over TCP.
    const overTcp = async () => String(await shared.client('LIST')).split('\n').filter((line) => / laddr=127\.0\.0\.1:/.test(line)).length;
    const tcpBefore = await overTcp();

    await lockEachWay(onOptions.locks, 'sock:options');
    await lockEachWay(onClient.locks, 'sock:client');
    const held = await onOptions.locks.acquire('sock:woken', { leaseMs: 120_000 });
    expect(await shared.exists('lock:{sock:woken}')).toBe(1);
    await wokenBy(() => held.release(), onClient, 'sock:woken', 5_000);
    const heldToo = await onClient.locks.acquire('sock:woken', { leaseMs: 120_000 });
    await wokenBy(() => heldToo.release(), onOptions, 'sock:woken', 5_000);

    expect(await overTcp()).toBe(tcpBefore);
    // Each app's connection and each waiter's subscriber connection. Redis and Valkey 8 write the
    // socket's laddr as "<path>:0", Valkey 9 as "[<path>:0]:0".
    const overSocket = String(await shared.client('LIST'))
      .split('\n')
      .filter((line) => line.split(' ').some((field) => field.startsWith('laddr=') && field.includes(socket))).length;
    expect(overSocket).toBeGreaterThanOrEqual(4);
    expect(await locksIn(shared)).toEqual([]);
    expect((await onOptions.locks.health()).status).toBe('up');
  });
});

// ioredis's enableAutoPipelining, common on a shared client, sends the commands of one tick as a
// pipeline: nestjs-locked's scripts go through it too.
describe("a client with ioredis's enableAutoPipelining", () => {
  const server = usePrivateServer();
  let raw: Redis;
  let client: Redis;
  let app: LockApp;
  let other: LockApp;

  beforeAll(async () => {
    raw = server.redis.shared();
    client = server.client({ enableAutoPipelining: true });
    app = await server.app({ redis: client });
    other = await server.app({ redis: { host: '127.0.0.1', port: server.redis.port, enableAutoPipelining: true } });
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
    expect(await locksIn(raw)).toEqual([]);
  });

  it('wakes a waiter of another process with the release message, and hands a fair lock over', async () => {
    const holder = await app.locks.acquire('ap:wake', { leaseMs: 120_000 });
    await wokenBy(() => holder.release(), other, 'ap:wake');

    await fairHandover(other, app, 'ap:fair', raw);
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

// ioredis's stringNumbers gives every integer reply as a string (for integers past 2^53): the
// scripts' hold counts, lease times and fencing tokens come back as strings.
describe("a client with ioredis's stringNumbers", () => {
  const server = usePrivateServer();
  let raw: Redis;
  let app: LockApp;
  let other: LockApp;

  beforeAll(async () => {
    ({ raw, passed: app, built: other } = await server.pair({ stringNumbers: true }));
  });

  it('counts holds, reads lease times and orders fencing tokens as numbers', async () => {
    await lockEachWay(app.locks, 'sn:each');
    const first = await app.locks.acquire('sn:one', { leaseMs: 5_000 });
    const inner = await first.run(() => app.locks.acquire('sn:one'));
    expect([first.holdCount, inner.holdCount, await first.run(() => app.locks.holdCount('sn:one'))]).toEqual([1, 2, 2]);
    const ttl = await app.locks.remainingTtl('sn:one');
    expect(typeof ttl).toBe('number');
    expect(ttl).toBeGreaterThan(4_000);
    await first.extend(60_000);
    expect(await app.locks.remainingTtl('sn:one')).toBeGreaterThan(50_000);
    await inner.release();
    expect(await first.run(() => app.locks.holdCount('sn:one'))).toBe(1);
    await expect(other.locks.acquire('sn:one', { waitMs: 0 })).rejects.toBeInstanceOf(LockNotAcquiredError);
    await first.release();
    const next = await other.locks.acquire('sn:one');
    expect(typeof next.fencingToken).toBe('number');
    expect(next.fencingToken).toBeGreaterThan(first.fencingToken);
    await next.release();
    // Several keys at once, one of them held: the script's refusal is read as one.
    const blocking = await other.locks.acquire('sn:b');
    await expect(app.locks.acquire(['sn:a', 'sn:b'], { waitMs: 0 })).rejects.toBeInstanceOf(LockNotAcquiredError);
    await blocking.release();
    const group = await app.locks.acquire(['sn:a', 'sn:b']);
    expect(Object.values(group.fencingTokens).every((t) => typeof t === 'number' && t > next.fencingToken)).toBe(true);
    await group.release();
    expect(await locksIn(raw)).toEqual([]);
  });

  it('renews: a 600 ms lease stays held across renewals', async () => {
    await staysHeldAcrossRenewals(app, 'sn:renew', 600, raw, 'lock:{sn:renew}');
  });

  it('wakes a waiter of another process with the release message, and hands a fair lock over', async () => {
    const holder = await app.locks.acquire('sn:wake', { leaseMs: 120_000 });
    await wokenBy(() => holder.release(), other, 'sn:wake');
    await fairHandover(other, app, 'sn:fair', raw);
  });
});

// ioredis 6 speaks RESP3 by default (the suite's other runs on ioredis 6), ioredis 5 RESP2 (the
// Nest 11 floor run). These are the two choices an ioredis 6 application can make against that
// default: RESP2, or RESP3 with its own reply types (maps as objects, doubles as numbers). ioredis 5
// ignores both options, so there they run as on its RESP2.
describe.each([
  ['protocol: 2 (RESP2 on ioredis 6)', { protocol: 2 }],
  ["replyMapping: 'resp3'", { protocol: 3, replyMapping: 'resp3' }],
])('a client with ioredis 6 %s', (_name, protocol) => {
  const server = usePrivateServer();
  let raw: Redis;
  let app: LockApp;
  let other: LockApp;

  beforeAll(async () => {
    ({ raw, passed: app, built: other } = await server.pair(protocol as RedisOptions));
  });

  it('takes locks each way, re-enters, renews, wakes a waiter of the other app and hands a fair lock over', async () => {
    await lockEachWay(app.locks, 'rp:each');
    const renewed = nextEvents(app.locks.events$, 'renewed', 2);
    const first = await app.locks.acquire('rp:one', { leaseMs: 600, watchdog: true });
    expect((await first.run(() => app.locks.acquire('rp:one'))).holdCount).toBe(2);
    await renewed;
    expect(await app.locks.remainingTtl('rp:one')).toBeGreaterThan(0);
    await wokenBy(() => first.run(() => app.locks.forceUnlock('rp:one')), other, 'rp:one');
    await fairHandover(other, app, 'rp:fair', raw);
    expect(await locksIn(raw)).toEqual([]);
  });
});

// BullMQ asks for maxRetriesPerRequest: null on its connections, so teams that share one with
// nestjs-locked have commands that wait in ioredis's offline queue for as long as Redis is away,
// instead of failing after a few reconnection attempts.
describe('a client with maxRetriesPerRequest: null (as BullMQ sets it) while Redis is down', () => {
  const server = usePrivateServer();
  let client: Redis;
  let app: LockApp;

  beforeAll(async () => {
    client = server.client({ maxRetriesPerRequest: null, enableReadyCheck: false, retryStrategy: () => 50 });
    app = await server.app({ redis: client, leaseMs: 1_500 });
  });

  it('reports the held lock lost at its deadline, bounds an acquisition and a release, and leaves no lock behind once Redis is back', async () => {
    const held = await app.locks.acquire('bq:held');
    const released = await app.locks.acquire('bq:released');
    await server.redis.kill();
    // A release waits in the offline queue too, for its 1 s bound.
    await expect(within(released.release(), 5_000)).rejects.toThrow(/^Redis failed during release of "bq:released": no answer within 1000 ms\./);
    // Renewals wait in the offline queue: the lease deadline, on this process's clock, ends the lock.
    expect(await aborted(held.signal)).toMatchObject({ reason: 'lease-expired' });
    // The attempt is bounded (at least 1 s) although its command waits in the queue.
    await expect(app.locks.acquire('bq:new', { waitMs: 200 })).rejects.toBeInstanceOf(LockBackendError);

    await server.redis.launch();
    // The queued commands run in order once the client is back: the abandoned attempt is granted
    // then, and given back as soon as its reply comes. Two round trips on the same connection
    // come after that reply and after the give-back.
    await client.ping();
    await client.ping();
    expect(await locksIn(server.redis.shared())).toEqual([]);
    const lock = await app.locks.acquire('bq:new', { waitMs: 0 });
    expect(lock.holdCount).toBe(1);
    await lock.release();
    await held.release(); // a no-op once lost
    expect(await locksIn(server.redis.shared())).toEqual([]);
  });
});

describe("a client with ioredis's lazyConnect, not connected yet", () => {
  const server = usePrivateServer();

  it.each([
    ['checked at bootstrap', {}],
    ['not checked (connectTimeoutMs: 0)', { connectTimeoutMs: 0 }],
  ])('connects it at bootstrap, %s', async (_name, options) => {
    const client = server.client({ lazyConnect: true });
    expect(client.status).toBe('wait');
    const app = await server.app({ redis: client, ...options });
    expect(client.status).not.toBe('wait');
    const lock = await app.locks.acquire('lazy:1', { waitMs: 0 });
    expect(client.status).toBe('ready');
    expect(await server.redis.shared().hgetall('lock:{lazy:1}')).toEqual({ [lock.owner]: '1' });
    await lock.release();
  });
});

// enableOfflineQueue: false makes ioredis refuse every command sent while the connection is not
// ready, instead of queueing it: the bootstrap check waits for the connection first, and the
// subscriber connection (nestjs-locked's own) queues its SUBSCRIBE whatever the client says.
describe("a client with ioredis's enableOfflineQueue: false", () => {
  const server = usePrivateServer();
  let passed: LockApp;
  let built: LockApp;

  beforeAll(async () => {
    passed = await server.app({ redis: server.client({ enableOfflineQueue: false }) });
    built = await server.app({ redis: { host: '127.0.0.1', port: server.redis.port, enableOfflineQueue: false } });
  });

  it('boots on a client passed in and on options, takes locks each way, and wakes a waiter by message', async () => {
    await lockEachWay(passed.locks, 'eoq:passed');
    await lockEachWay(built.locks, 'eoq:built');
    const holder = await passed.locks.acquire('eoq:wake', { leaseMs: 120_000 });
    await wokenBy(() => holder.release(), built, 'eoq:wake');
    const fixed = await built.locks.acquire('eoq:wake2', { leaseMs: 120_000 });
    await wokenBy(() => fixed.release(), passed, 'eoq:wake2');
    expect(await locksIn(server.redis.shared())).toEqual([]);
  });

  it('fails a lock step at once while Redis is down, with the refusal as its cause, and locks again once it is back', async () => {
    await server.redis.kill();
    const failure = await passed.locks.acquire('eoq:down', { waitMs: 60_000 }).then(
      () => new Error('acquired'),
      (e: unknown) => e,
    );
    expect(failure).toBeInstanceOf(LockBackendError);
    // ioredis's own refusal, not the attempt's bound (60 s here) running out.
    expect(String((failure as Error & { cause?: unknown }).cause)).toMatch(/Stream isn't writeable and enableOfflineQueue options is false/);
    await server.redis.launch();
    await until(async () => (await passed.locks.health()).status === 'up', 10_000, 'the client back');
    await (await passed.locks.acquire('eoq:down', { waitMs: 0 })).release();
  });
});

// ioredis's commandTimeout rejects a command it gave up on, while Redis may still run it: a lock
// step would not know whether it took a lock.
describe("a client with ioredis's commandTimeout", () => {
  const server = usePrivateServer();
  let shared: Redis;
  let passed: LockApp;
  let built: LockApp;

  beforeAll(async () => {
    shared = server.client({ commandTimeout: 200 });
    passed = await server.app({ redis: shared });
    built = await server.app({ redis: { host: '127.0.0.1', port: server.redis.port, commandTimeout: 200 } });
  });

  it('leaves no lock behind when Redis holds an acquisition past the commandTimeout: the attempt is bounded and given back', async () => {
    for (const [app, key] of [[passed, 'ct:passed'], [built, 'ct:built']] as const) {
      // Not at the 200 ms commandTimeout: at the attempt's own 1 s bound, which gives back a late grant.
      expect(String((await attemptHeldUp(app, key, [server.redis.shared()])).cause)).toMatch(/no answer within 1000 ms/);
      await (await app.locks.acquire(key, { waitMs: 0 })).release();
    }
  });

  it('keeps the client passed in as it is, with its commandTimeout, and says why lock steps run on a copy', async () => {
    expect(shared.options.commandTimeout).toBe(200);
    expect(await shared.ping()).toBe('PONG');
    expect(passed.logger.at('log').filter((m) => m.includes('ioredis commandTimeout (200 ms)') && m.includes('a copy of the client passed in'))).toHaveLength(1);
    // Given as options, it is left out of the connection nestjs-locked makes, and the log says so too.
    expect(built.logger.at('log').filter((m) => m.includes('ioredis commandTimeout (200 ms)') && m.endsWith('Lock steps run without it.'))).toHaveLength(1);
    // It names the bound the steps run with instead, and the option that sets it.
    expect(built.logger.at('log').filter((m) => m.includes('bounds its lock steps itself, by stepTimeoutMs (1000 ms;'))).toHaveLength(1);
    const patient = await server.app({ redis: { host: '127.0.0.1', port: server.redis.port, commandTimeout: 200 }, stepTimeoutMs: 2_500 });
    expect(patient.logger.at('log').filter((m) => m.includes('bounds its lock steps itself, by stepTimeoutMs (2500 ms;'))).toHaveLength(1);
  });
});

// The same on Redlock's node clients (passed in, and as options): a node that ran an acquisition
// its client gave up on would keep a lock nobody gives back, and a majority of such nodes would
// keep the key from everyone for the whole lease.
describe("Redlock nodes with ioredis's commandTimeout", () => {
  let nodes: RedisServer[];
  const clients: Redis[] = [];
  const apps: LockApp[] = [];
  beforeAll(async () => {
    nodes = await Promise.all([0, 1, 2].map(() => RedisServer.start()));
    clients.push(...nodes.map((n) => new Redis(n.port, '127.0.0.1', { commandTimeout: 200 })));
    apps.push(await startLockApp({ redlock: { clients } }));
    apps.push(await startLockApp({ redlock: { clients: nodes.map((n) => ({ host: '127.0.0.1', port: n.port, commandTimeout: 200 })) } }));
  });
  afterAll(async () => {
    for (const app of apps.splice(0)) await app.close();
    for (const client of clients.splice(0)) client.disconnect();
    await Promise.all((nodes ?? []).map((n) => n.stop()));
  });

  it('takes locks each way on clients passed in, and wakes a waiter of the other app by message, both ways round', async () => {
    await lockEachWay(apps[0]!.locks, 'rl:passed');
    const holder = await apps[0]!.locks.acquire('rl:wake', { leaseMs: 120_000 });
    await wokenBy(() => holder.release(), apps[1]!, 'rl:wake');
    const other = await apps[1]!.locks.acquire('rl:wake2', { leaseMs: 120_000 });
    await wokenBy(() => other.release(), apps[0]!, 'rl:wake2');
    // The last release returns once two nodes answered; the third follows.
    await until(async () => (await Promise.all(nodes.map((n) => locksIn(n.shared())))).every((left) => left.length === 0), 5_000, 'nothing left on the nodes');
  });

  it('leaves node clients passed in open at shutdown (they are the application\'s), and uses them as they are', async () => {
    const plain = nodes.map((n) => new Redis(n.port, '127.0.0.1'));
    clients.push(...plain);
    const ids = await Promise.all(plain.map(async (c) => Number(await c.client('ID'))));
    const app = await startLockApp({ redlock: { clients: plain } });
    const lock = await app.locks.acquire('rl:plain');
    // No copy: the acquisition went over each client passed in (one node may run it after the quorum).
    const lastCommand = async (i: number) => /cmd=(\S+)/.exec(String(await nodes[i]!.shared().client('LIST', 'ID', ids[i]!)))?.[1];
    await until(async () => (await Promise.all(nodes.map((_, i) => lastCommand(i)))).every((cmd) => cmd === 'evalsha'), 5_000, 'the acquisition on every client passed in');
    await lock.release();
    await app.close();
    expect(await Promise.all(plain.map((c) => c.ping()))).toEqual(['PONG', 'PONG', 'PONG']);
    expect(plain.map((c) => c.status)).toEqual(['ready', 'ready', 'ready']);
  });

  it.each([
    ['checked at bootstrap', {}],
    ['not checked (connectTimeoutMs: 0)', { connectTimeoutMs: 0 }],
  ])('connects node clients passed in with lazyConnect at bootstrap, %s', async (_name, options) => {
    const lazy = nodes.map((n) => new Redis(n.port, '127.0.0.1', { lazyConnect: true }));
    clients.push(...lazy);
    const app = await startLockApp({ redlock: { clients: lazy }, ...options });
    try {
      expect(lazy.map((c) => c.status)).not.toContain('wait');
      const lock = await app.locks.acquire('rl:lazy', { waitMs: 0 });
      await lock.release();
    } finally {
      await app.close();
    }
  });

  it('leaves no lock on any node when a majority holds an acquisition past the commandTimeout, and keeps the clients passed in as they are', async () => {
    const all = nodes.map((n) => n.shared());
    for (const [i, app] of apps.entries()) {
      const key = `ct:redlock:${i}`;
      // The nodes run the attempt once unpaused; each late grant is given back, on every node.
      const failure = await attemptHeldUp(app, key, all.slice(1), LockQuorumError, all);
      // Not ioredis's "Command timed out" at 200 ms: the per-node bound (500 ms for a 30 s lease).
      expect(failure.message).not.toMatch(/Command timed out/);
      await (await app.locks.acquire(key, { waitMs: 0 })).release();
    }
    for (const client of clients.slice(0, 3)) expect(client.options.commandTimeout).toBe(200);
    expect(apps[0]!.logger.at('log').filter((m) => m.includes('ioredis commandTimeout (200 ms)'))).toHaveLength(3);
  });
});

// The same options on a Cluster client, on one 3-master cluster.
describe('on a Cluster client', () => {
  let cluster: RedisCluster;
  beforeAll(async () => {
    cluster = await RedisCluster.start();
  });
  afterAll(async () => {
    await cluster?.stop();
  });

  /** Apps started by `start` before the block's tests, closed after them (before the cluster stops). */
  function useApps(start: () => Promise<LockApp>[]): { passed: LockApp; built: LockApp } {
    const apps = {} as { passed: LockApp; built: LockApp };
    beforeAll(async () => {
      [apps.passed, apps.built] = await Promise.all(start());
    });
    afterAll(async () => {
      await apps.passed?.close();
      await apps.built?.close();
    });
    return apps;
  }

  // Releases are announced with sharded pub/sub there, and ioredis counts a shard channel as a
  // key: it prefixes SSUBSCRIBE's channels, but not the channel a script publishes to.
  describe("with ioredis's own keyPrefix", () => {
    const apps = useApps(() => [
      startLockApp({ redis: cluster.client({ keyPrefix: 'app:' }) }),
      // The prefix in the Cluster's redisOptions, which ioredis takes as the Cluster's own.
      startLockApp({ redis: { cluster: cluster.nodes, options: { redisOptions: { keyPrefix: 'app:' } } } }),
    ]);
    const namesOf = async (key: string) => (await cluster.node(await cluster.ownerOf(keySlot(key))).keys(`*{${key}}*`)).sort();

    it('writes every name of a lock under the prefix, on the node that serves its slot, and leaves nothing behind', async () => {
      const { passed, built } = apps;
      const held = await passed.locks.acquire('cp:held');
      expect(await namesOf('cp:held')).toEqual(['app:lock:{cp:held}', 'app:lock:{cp:held}:fence']);
      expect(await built.locks.isLocked('cp:held')).toBe(true);
      await expect(built.locks.acquire('cp:held', { waitMs: 0 })).rejects.toBeInstanceOf(LockNotAcquiredError);
      await held.release();
      await lockEachWay(passed.locks, 'cp:each');
      await lockEachWay(built.locks, 'cb:each');
      expect((await namesOf('cp:held')).filter((k) => !k.endsWith(':fence'))).toEqual([]);
    });

    it('wakes a waiter of another process with the release message, each way', async () => {
      const holder = await apps.passed.locks.acquire('cp:wake', { leaseMs: 120_000 });
      await wokenBy(() => holder.release(), apps.built, 'cp:wake');
      const other = await apps.built.locks.acquire('cp:wake2', { leaseMs: 120_000 });
      await wokenBy(() => other.release(), apps.passed, 'cp:wake2');
    });

    it('hands a fair lock to the queued waiter of another process', async () => {
      const owner = cluster.node(await cluster.ownerOf(keySlot('cp:fair')));
      await fairHandover(apps.built, apps.passed, 'cp:fair', owner, 'app:');
    });
  });

  describe("with ioredis's commandTimeout in redisOptions", () => {
    const apps = useApps(() => [
      startLockApp({ redis: cluster.client({ redisOptions: { commandTimeout: 200 } }) }),
      startLockApp({ redis: { cluster: cluster.nodes, options: { redisOptions: { commandTimeout: 200 } } } }),
    ]);

    it('leaves no lock behind when the master holds an acquisition past the commandTimeout', async () => {
      for (const [app, key] of [[apps.passed, 'cct:passed'], [apps.built, 'cct:built']] as const) {
        expect(String((await attemptHeldUp(app, key, [cluster.node(await cluster.ownerOf(keySlot(key)))])).cause)).toMatch(/no answer within 1000 ms/);
      }
    });
  });

  describe("with ioredis's enableOfflineQueue: false", () => {
    const apps = useApps(() => [
      startLockApp({ redis: cluster.client({ enableOfflineQueue: false }) }),
      startLockApp({ redis: { cluster: cluster.nodes, options: { enableOfflineQueue: false } } }),
    ]);

    it('boots on a client passed in and on options, takes locks each way, and wakes a waiter by message', async () => {
      const { passed, built } = apps;
      await lockEachWay(passed.locks, 'ceoq:passed');
      await lockEachWay(built.locks, 'ceoq:built');
      const holder = await passed.locks.acquire('ceoq:wake', { leaseMs: 120_000 });
      await wokenBy(() => holder.release(), built, 'ceoq:wake');
      const fixed = await built.locks.acquire('ceoq:wake2', { leaseMs: 120_000 });
      await wokenBy(() => fixed.release(), passed, 'ceoq:wake2');
    });
  });
});
