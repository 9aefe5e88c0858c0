import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Redis } from 'ioredis';
import { LockLostError, LockReplicationError } from '../../lib/index.js';
import { RedisSentinelSet } from '../support/redis-sentinel.js';
import { until } from '../support/redis-server.js';
import { aborted, elsewhere, nextEvent, startLockApp, wokenBy, type LockApp } from '../support/lock-testing.js';

/**
 * Redis Sentinel: a master, a replica and 3 sentinels started by the harness. The lock module
 * connects through the sentinels (ioredis `sentinels` + `name`), with replica confirmation on, and
 * must survive the master being killed: held locks keep renewing on the promoted replica, new
 * locks work, and nothing restarts.
 */
describe('Redis Sentinel', () => {
  let set: RedisSentinelSet;
  let app: LockApp;

  beforeAll(async () => {
    set = await RedisSentinelSet.start();
    app = await startLockApp({
      redis: { sentinels: set.nodes, name: set.name },
      leaseMs: 6_000,
      waitMs: 10_000,
      // WAIT blocks the lock connection: a renewal's WAIT that finds no replica (after the
      // failover) holds the steps behind it this long, well within an attempt's 1 s minimum.
      replication: { replicas: 1, timeoutMs: 400 },
    });
  }, 60_000);
  afterAll(async () => {
    await app?.close();
    await set?.stop();
  });

  it('takes locks on the master the sentinels name, confirmed by the replica', async () => {
    const lock = await app.locks.acquire('s:first');
    // WAIT returned before acquire did: the replica has the lock already.
    expect(await set.direct(set.replica).hget('lock:{s:first}', lock.owner)).toBe('1');
    await lock.release();
    expect(await set.direct(set.replica).exists('lock:{s:first}')).toBe(0);
  });

  it("keeps ioredis's keyPrefix and db through the sentinels: the names on the master, under the prefix, in that database, and releases still wake waiters", async () => {
    const options = { sentinels: set.nodes, name: set.name, keyPrefix: 'app:', db: 3 };
    const [one, other] = await Promise.all([startLockApp({ redis: options }), startLockApp({ redis: options })]);
    const inDb3 = new Redis(set.master.port, '127.0.0.1', { db: 3 });
    try {
      const held = await one.locks.acquire('s:shared', { leaseMs: 120_000 });
      expect(await inDb3.hgetall('app:lock:{s:shared}')).toEqual({ [held.owner]: '1' });
      expect(await set.direct(set.master).exists('app:lock:{s:shared}', 'lock:{s:shared}')).toBe(0);
      await wokenBy(() => held.release(), other, 's:shared');
      expect(await inDb3.exists('app:lock:{s:shared}')).toBe(0);
    } finally {
      inDb3.disconnect();
      await one.close();
      await other.close();
    }
  });

  it('works on a Sentinel-managed ioredis client passed in, with replication (such a client was once taken for a Cluster client and refused)', async () => {
    const client = new Redis({ sentinels: set.nodes, name: set.name });
    let passed: LockApp | undefined;
    try {
      passed = await startLockApp({ redis: client, replication: { replicas: 1, timeoutMs: 400 } });
      const lock = await passed.locks.acquire('s:passed', { leaseMs: 120_000 });
      expect(await set.direct(set.replica).hget('lock:{s:passed}', lock.owner)).toBe('1');
      await wokenBy(() => lock.release(), app, 's:passed');
      expect(await set.direct(set.replica).exists('lock:{s:passed}')).toBe(0);
    } finally {
      await passed?.close();
      client.disconnect();
    }
  });

  it('after the master is killed and the replica promoted, held locks keep renewing on the new master and new locks work', async () => {
    const held = await app.locks.acquire('s:held');
    const lost: string[] = [];
    const watching = app.locks.events$.subscribe((e) => void (e.type === 'lost' && lost.push(e.key)));
    const oldMaster = set.master.port;
    await set.failover();
    expect(await set.masterPort()).not.toBe(oldMaster);
    // A renewal that reaches the promoted master succeeds: the replica had the lock.
    await nextEvent(app.locks.events$, 'renewed', (e) => e.key === 's:held', 15_000);
    expect(held.isHeld).toBe(true);
    expect(await set.direct(set.master).hget('lock:{s:held}', held.owner)).toBe('1');
    expect(await elsewhere(() => app.locks.tryAcquire('s:held'))).toBeNull();
    // No replica is left to confirm a new lock: it is refused and given back, not kept unconfirmed.
    await expect(elsewhere(() => app.locks.acquire('s:after-failover'))).rejects.toThrow(LockReplicationError);
    expect(await app.locks.isLocked('s:after-failover')).toBe(false);
    // The old master comes back as a replica of the new one: new locks work, without a restart.
    await set.rejoin();
    const fresh = await elsewhere(() => app.locks.acquire('s:after-failover'));
    expect(await set.direct(set.master).exists('lock:{s:after-failover}')).toBe(1);
    await fresh.release();
    await held.release();
    expect(await app.locks.isLocked('s:held')).toBe(false);
    watching.unsubscribe();
    expect(lost).toEqual([]);
  }, 60_000);
});

/**
 * The failover that asynchronous replication allows: the master granted a lock, died before its
 * replica received it, and the sentinels promoted that replica. The replica's link to the master
 * runs through a proxy the test stalls (`holdReplication`), so the lock is missing on the promoted
 * master for certain.
 */
describe('Redis Sentinel: a lock the promoted replica never received', () => {
  let set: RedisSentinelSet;
  let first: LockApp;
  let second: LockApp;

  beforeAll(async () => {
    set = await RedisSentinelSet.start({ replicationProxy: true });
    // A 10 s lease: renewal every 3.3 s, retried each second while the failover runs, so the
    // holder reaches the promoted master well before its local deadline.
    const options = { redis: { sentinels: set.nodes, name: set.name }, leaseMs: 10_000 };
    first = await startLockApp(options);
    second = await startLockApp(options);
  }, 60_000);
  afterAll(async () => {
    await first?.close();
    await second?.close();
    await set?.stop();
  });

  it("lets another owner take it on the new master, and the holder's next renewal aborts its signal (taken)", async () => {
    // While the link is open, a lock reaches the replica.
    const replicated = await first.locks.acquire('s:replicated');
    await until(async () => (await set.direct(set.replica).hget('lock:{s:replicated}', replicated.owner)) === '1', 10_000, 'the replica never received the lock');
    set.holdReplication();
    const held = await first.locks.acquire('s:unreplicated');
    expect(await set.direct(set.master).hget('lock:{s:unreplicated}', held.owner)).toBe('1');
    const lost = nextEvent(first.locks.events$, 'lost', (e) => e.key === 's:unreplicated', 30_000);
    await set.failover();
    expect(await set.direct(set.master).hget('lock:{s:replicated}', replicated.owner)).toBe('1');
    expect(await set.direct(set.master).exists('lock:{s:unreplicated}')).toBe(0);
    // Two owners now: the new master lets another one in while the first still holds its handle.
    const other = await second.locks.acquire('s:unreplicated', { waitMs: 20_000 });
    expect(await set.direct(set.master).hget('lock:{s:unreplicated}', other.owner)).toBe('1');
    // The first holder's renewal on the new master is refused: it is told, not left believing.
    expect((await lost).reason).toBe('taken');
    const reason = await aborted(held.signal);
    expect(reason).toBeInstanceOf(LockLostError);
    expect((reason as LockLostError).reason).toBe('taken');
    expect(held.isHeld).toBe(false);
    // The other owner's lock is untouched by the first holder's loss and release.
    await held.release();
    expect(await set.direct(set.master).hget('lock:{s:unreplicated}', other.owner)).toBe('1');
    await other.release();
    expect(await set.direct(set.master).exists('lock:{s:unreplicated}')).toBe(0);
    // The lock the replica had kept renewing on the new master all along.
    expect(replicated.isHeld).toBe(true);
    await replicated.release();
  }, 90_000);
});
