import { AsyncResource } from 'node:async_hooks';
import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { LockReplicationError } from '../../lib/index.js';
import { RedisSentinelSet } from '../support/redis-sentinel.js';
import { nextEvent, startLockApp, type LockApp } from '../support/lock-testing.js';

/**
 * Redis Sentinel: a master, a replica and 3 sentinels started by the harness. The lock module
 * connects through the sentinels (ioredis `sentinels` + `name`), with replica confirmation on, and
 * must survive the master being killed: held locks keep renewing on the promoted replica, new
 * locks work, and nothing restarts.
 */
describe('Redis Sentinel', () => {
  let set: RedisSentinelSet;
  let app: LockApp;
  const elsewhere = <T>(fn: () => Promise<T>) => new AsyncResource('elsewhere').runInAsyncScope(fn);

  beforeAll(async () => {
    set = await RedisSentinelSet.start();
    app = await startLockApp({
      redis: { sentinels: set.nodes, name: set.name },
      leaseMs: 6_000,
      waitMs: 10_000,
      replication: { replicas: 1, timeoutMs: 1_000 },
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
