import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { exists, hasFlag } from '@ioredis/commands';
import { Cluster } from 'ioredis';
import { filter } from 'rxjs';
import { LockService, type LockLostError } from '../../lib/index.js';
import { keySlot } from '../../lib/store/redis/redis-lock.store.js';
import { RedisCluster } from '../support/redis-cluster.js';
import { scriptCalls, tcpProxy, until, type RedisServer } from '../support/redis-server.js';
import { aborted, elsewhere, firstAfterRelease, listenerCounts, lockEachWay, nextEvent, nextEvents, startLockApp, waitRegistered, type LockApp } from '../support/lock-testing.js';

/**
 * Redis Cluster specifics (the common behaviour runs on a Cluster in behaviour.spec.ts): a local
 * 3-master cluster started from `redis-server --cluster-enabled yes` and `redis-cli --cluster create`.
 */
describe('Redis Cluster', () => {
  let cluster: RedisCluster;
  let app: LockApp;
  let probe: Cluster;

  beforeAll(async () => {
    cluster = await RedisCluster.start(3);
    app = await startLockApp({ redis: { cluster: cluster.nodes }, leaseMs: 600, waitMs: 10_000 });
    probe = cluster.client();
  });
  afterAll(async () => {
    await app?.close();
    await cluster?.stop();
  });

  it('computes the slot Redis computes, and keeps every name of one lock in that slot', async () => {
    for (const key of ['a', 'order:42', 'user:{x', 'ключ', 'x'.repeat(300)].filter((k) => !k.includes('{'))) {
      const slot = Number(await probe.cluster('KEYSLOT', `lock:{${key}}`));
      expect(keySlot(key)).toBe(slot);
      expect(Number(await probe.cluster('KEYSLOT', `lock:{${key}}:fence`))).toBe(slot);
      expect(Number(await probe.cluster('KEYSLOT', `lock:{${key}}:queue:timeouts`))).toBe(slot);
      expect(Number(await probe.cluster('KEYSLOT', `lock:{${key}}:queue:leases`))).toBe(slot);
    }
  });

  it('spreads locks over every master and renews them all, grouped by slot, for more than 3 leases', async () => {
    const keys = Array.from({ length: 60 }, (_, i) => `spread:${i}`);
    const handles = await Promise.all(keys.map((key) => elsewhere(() => app.locks.acquire(key))));
    const perMaster = await Promise.all(cluster.servers.map((s) => cluster.node(s).dbsize()));
    expect(perMaster.every((n) => n > 0)).toBe(true);
    // 60 locks renewed 4 times: every renewal reported, none lost.
    const lost: string[] = [];
    const watching = app.locks.events$.subscribe((e) => void (e.type === 'lost' && lost.push(e.key)));
    await nextEvents(app.locks.events$, 'renewed', 60 * 4, 10_000);
    watching.unsubscribe();
    expect(lost).toEqual([]);
    for (const h of handles) expect(h.isHeld).toBe(true);
    expect(await elsewhere(() => app.locks.tryAcquire(keys[7]!))).toBeNull();
    await Promise.all(handles.map((h) => h.release()));
    expect(await app.locks.isLocked(keys[7]!)).toBe(false);
  });

  it('announces a lease set shorter with sharded pub/sub from inside the script, so waiters learn it', async () => {
    const key = 'shortened';
    const owner = await cluster.ownerOf(keySlot(key));
    const sub = cluster.node(owner).duplicate();
    try {
      const messages: string[] = [];
      const released = new Promise<void>((resolve) =>
        sub.on('smessage', (channel: string, message: string) => {
          messages.push(`${channel} ${message}`);
          if (message === 'released') resolve();
        }),
      );
      await sub.ssubscribe(`lock:{${key}}`);
      const holder = await app.locks.acquire(key, { leaseMs: 60_000 });
      await holder.extend(120_000);
      await holder.extend(30_000);
      await holder.release();
      await released;
      // A longer lease is not announced; the shorter one is (`all`), then the release.
      expect(messages).toEqual([`lock:{${key}} all`, `lock:{${key}} released`]);
    } finally {
      sub.disconnect();
    }
  });

  it('announces releases with sharded pub/sub on the node that serves the lock', async () => {
    const holder = await app.locks.acquire('sharded');
    const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === 'sharded');
    const waiting = elsewhere(() => app.locks.acquire('sharded'));
    await contended;
    // The waiter subscribes right after its first refused attempt ('contended'): poll until its
    // subscription shows. It is a shard channel on the lock's own node, and nowhere else (PUBSUB
    // SHARDNUMSUB under-reports on Redis 7.0, so the channel list is what is checked).
    const owner = await cluster.ownerOf(keySlot('sharded'));
    const shardChannels = async (server: typeof owner) => (await cluster.node(server).call('PUBSUB', 'SHARDCHANNELS')) as string[];
    for (let i = 0; !(await shardChannels(owner)).includes('lock:{sharded}'); i++) {
      if (i > 100) throw new Error('the waiter never subscribed');
      await new Promise((r) => setTimeout(r, 20));
    }
    for (const server of cluster.servers) {
      const channels = await shardChannels(server);
      expect({ port: server.port, sharded: channels.includes('lock:{sharded}') }).toEqual({ port: server.port, sharded: server === owner });
      expect(await cluster.node(server).call('PUBSUB', 'CHANNELS')).toEqual([]);
    }
    await holder.release();
    await (await waiting).release();
    // The wait is over: its shard channel is given up (SUNSUBSCRIBE; a plain UNSUBSCRIBE would not).
    await until(async () => !(await shardChannels(owner)).includes('lock:{sharded}'), 5_000, 'the shard channel stayed subscribed after its wait');
  });

  it('hands a fair lock to a waiter of another service over sharded pub/sub, with no Redis call of the waiter', async () => {
    const key = 'fair-handover';
    const other = await startLockApp({ redis: { cluster: cluster.nodes }, leaseMs: 60_000 });
    try {
      const holder = await other.locks.acquire(key, { fair: true });
      const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === key);
      const waiting = elsewhere(() => app.locks.acquire(key, { fair: true, leaseMs: 60_000, watchdog: true, waitMs: 30_000 }));
      const { owner } = await contended;
      const node = cluster.node(await cluster.ownerOf(keySlot(key)));
      // From then on the waiter sleeps up to 2.5 s.
      await waitRegistered(node, key, owner);
      await node.config('RESETSTAT');
      await holder.release();
      const lock = await waiting;
      expect(await scriptCalls(node)).toBe(1);
      expect(lock.fencingToken).toBeGreaterThan(holder.fencingToken);
      await lock.release();
      expect(await app.locks.isLocked(key)).toBe(false);
    } finally {
      await other.close();
    }
  });

  it('lets a release take a waiter of its process along: its attempt follows on the same node, ahead of another service', async () => {
    const other = await startLockApp({ redis: { cluster: cluster.nodes }, leaseMs: 600 });
    try {
      // Keys over several slots, so over every master; woken by the release message instead, either waiter could win.
      expect(await firstAfterRelease(app, other, 'along', 20)).toEqual(Array(20).fill('mine'));
    } finally {
      await other.close();
    }
  });

  it('keeps a held lock through a migration of its slot, and its waiter still gets it', async () => {
    const key = 'migrating';
    const slot = keySlot(key);
    const holder = await app.locks.acquire(key);
    const contended = nextEvent(app.locks.events$, 'contended', (e) => e.key === key);
    const waiting = elsewhere(() => app.locks.acquire(key, { waitMs: 20_000 }));
    await contended;
    const source = await cluster.ownerOf(slot);
    const target = cluster.servers.find((s) => s !== source)!;
    await cluster.migrateSlot(slot, target);
    expect(await cluster.ownerOf(slot)).toBe(target);
    expect(await cluster.node(target).exists(`lock:{${key}}`, `lock:{${key}}:fence`)).toBe(2);
    // Renewal follows the slot (MOVED), the lock stays held and exclusive.
    await nextEvents(app.locks.events$, 'renewed', 3, 5_000);
    expect(holder.isHeld).toBe(true);
    expect(await elsewhere(() => app.locks.tryAcquire(key))).toBeNull();
    const token = holder.fencingToken;
    await holder.release();
    const next = await waiting;
    expect(next.fencingToken).toBeGreaterThan(token);
    await next.release();
    expect(await app.locks.isLocked(key)).toBe(false);
  });

  it('accepts a Cluster client the app created, and leaves it open at shutdown, with no listener of it on the client or its nodes', async () => {
    const client = cluster.client();
    await client.ping();
    const listening = () => [listenerCounts(client), ...client.nodes().map(listenerCounts)];
    const before = listening();
    const other = await startLockApp({ redis: client, leaseMs: 600 });
    expect((await other.locks.health()).store).toMatch(/^redis cluster /);
    await other.locks.run('own-client', async () => expect(await app.locks.isLocked('own-client')).toBe(true));
    expect(listening()).not.toEqual(before);
    await other.close();
    expect(listening()).toEqual(before);
    expect(client.status).toBe('ready');
    expect(other.moduleRef.get(LockService)).toBeDefined();
  });

  it('warns at bootstrap when a master may evict lock keys, naming that master', async () => {
    const [, second] = cluster.servers;
    const node = cluster.node(second!);
    await node.config('SET', 'maxmemory', '100mb', 'maxmemory-policy', 'allkeys-lru');
    try {
      const other = await startLockApp({ redis: { cluster: cluster.nodes } });
      await other.close();
      expect(other.logger.at('warn')).toEqual([
        expect.stringMatching(new RegExp(`^redis cluster .* \\(master 127\\.0\\.0\\.1:${second!.port}\\) may evict lock keys: maxmemory is 104857600 bytes with maxmemory-policy allkeys-lru`)),
      ]);
    } finally {
      await node.config('SET', 'maxmemory', '0', 'maxmemory-policy', 'noeviction');
    }
  });

  it('with an ACL user without the lock channels: warns at bootstrap, and releases free their locks (SPUBLISH refused)', async () => {
    // ACLs are per node: the user is made on every one.
    await Promise.all(cluster.servers.map((s) => cluster.node(s).call('ACL', 'SETUSER', 'nochannels', 'on', '>nochannels-password', '~*', '+@all', 'resetchannels')));
    const other = await startLockApp({ redis: { cluster: cluster.nodes, options: { redisOptions: { username: 'nochannels', password: 'nochannels-password' } } } });
    try {
      expect(other.logger.at('warn')).toEqual([expect.stringMatching(/^redis cluster .* refused a publish on a lock channel \(.*\)\. Locks still work.*&lock:\*/)]);
      const failed: unknown[] = [];
      const watching = other.locks.events$.subscribe((e) => void (e.type === 'release-failed' && failed.push(e.error)));
      expect(await other.locks.run('acl-cluster', async () => 'ran')).toBe('ran');
      watching.unsubscribe();
      expect(failed).toEqual([]);
      expect(await app.locks.isLocked('acl-cluster')).toBe(false);
    } finally {
      await other.close();
      await Promise.all(cluster.servers.map((s) => cluster.node(s).call('ACL', 'DELUSER', 'nochannels')));
    }
  });

  it('connects a Cluster client created with lazyConnect at the bootstrap check', async () => {
    const client = cluster.client({ lazyConnect: true });
    expect(client.status).toBe('wait');
    const other = await startLockApp({ redis: client, leaseMs: 600, connectTimeoutMs: 5_000 });
    expect(client.status).toBe('ready');
    await other.locks.run('lazy-client', async () => expect(await app.locks.isLocked('lazy-client')).toBe(true));
    await other.close();
  });
});

/**
 * A master failover inside the Cluster: 3 masters with one replica each; the master serving a held
 * lock is SIGKILLed and the cluster promotes its replica (node timeout 2 s, then a vote).
 */
describe('Redis Cluster: master failover', () => {
  let cluster: RedisCluster;
  let app: LockApp;

  beforeAll(async () => {
    cluster = await RedisCluster.start(3, 1);
    // A 10 s lease, well beyond the 3 to 5 s the failover takes here (a renewal that falls into it
    // fails and is retried each second), so the held lock outlives it on a loaded machine too.
    app = await startLockApp({ redis: { cluster: cluster.nodes }, leaseMs: 10_000, waitMs: 20_000 });
  }, 60_000);
  afterAll(async () => {
    await app?.close();
    await cluster?.stop();
  });

  it("reads and writes every lock on its master under ioredis's scaleReads: 'slave': a replica, which may lag, is never asked", async () => {
    // A Cluster client shared with code that reads from replicas. A lock read from a replica that
    // has not received it yet would look free (and a force-unlock would find nothing to delete).
    const key = 'scale:reads';
    const slot = keySlot(key);
    const replica = cluster.node(await cluster.replicaOf(await cluster.ownerOf(slot)));
    // The Cluster client learns the replica from CLUSTER SLOTS at its start, once Redis lists it there.
    const listed = async () => ((await replica.call('CLUSTER', 'SLOTS')) as unknown[][]).some((r) => Number(r[0]) <= slot && slot <= Number(r[1]) && r.length > 3);
    await until(listed, 20_000, 'the replica never listed in CLUSTER SLOTS');
    const reads = await startLockApp({ redis: { cluster: cluster.nodes, options: { scaleReads: 'slave' } } });
    // Every read command the replica ran (the writes it replays from its master count too in its
    // statistics, and are left out; so are subcommands such as CLUSTER SLOTS, which ioredis sends anywhere).
    const readsOnReplica = async () =>
      [...String(await replica.info('commandstats')).matchAll(/cmdstat_([a-z_]+):calls=(\d+)/g)].filter(([, c]) => exists(c!) && hasFlag(c!, 'readonly')).map(([, c, n]) => `${c}=${n}`);
    try {
      const before = await readsOnReplica();
      const held = await reads.locks.acquire(key);
      expect(await reads.locks.isLocked(key)).toBe(true);
      expect(await reads.locks.holdCount(key, { owner: held.owner })).toBe(1);
      expect(await reads.locks.remainingTtl(key)).toBeGreaterThan(0);
      expect(await reads.locks.forceUnlock(key)).toBe(true);
      expect(await reads.locks.isLocked(key)).toBe(false);
      await lockEachWay(reads.locks, key);
      expect(await readsOnReplica()).toEqual(before);
    } finally {
      await reads.close();
    }
  });

  it('follows the promoted replica: a held lock it received keeps renewing there, and the slot takes new locks', async () => {
    const key = 'failover:held';
    const slot = keySlot(key);
    const held = await app.locks.acquire(key);
    const replica = await cluster.replicaOf(await cluster.ownerOf(slot));
    await cluster.node(replica).call('READONLY'); // a replica answers reads of its slots only after READONLY
    const onReplica = () => cluster.node(replica).hget(`lock:{${key}}`, held.owner);
    await until(async () => (await onReplica()) === '1', 10_000, 'the replica never received the lock');
    const lost: string[] = [];
    const watching = app.locks.events$.subscribe((e) => void (e.type === 'lost' && lost.push(e.key)));
    const promoted = await cluster.failover(slot);
    // A renewal after the promotion reaches the new master and succeeds.
    await nextEvent(app.locks.events$, 'renewed', (e) => e.key === key, 20_000);
    expect(held.isHeld).toBe(true);
    expect(Number(await cluster.node(promoted).pttl(`lock:{${key}}`))).toBeGreaterThan(5_000);
    // Another owner is refused on the new master, then gets the lock once it is released.
    expect(await elsewhere(() => app.locks.tryAcquire(key))).toBeNull();
    const waiting = elsewhere(() => app.locks.acquire(key));
    await held.release();
    const next = await waiting;
    expect(await cluster.node(promoted).hget(`lock:{${key}}`, next.owner)).toBe('1');
    await next.release();
    expect(await cluster.node(promoted).exists(`lock:{${key}}`)).toBe(0);
    watching.unsubscribe();
    expect(lost).toEqual([]);
  }, 90_000);
});

/**
 * A master down for good (no replica to promote), on a cluster that keeps serving the slots it
 * still covers (`cluster-require-full-coverage no`): locks on the other masters must not suffer.
 */
describe('Redis Cluster: a master down, the others serving', () => {
  let cluster: RedisCluster;
  let app: LockApp;

  beforeAll(async () => {
    cluster = await RedisCluster.start(3, 0, ['--cluster-require-full-coverage', 'no']);
    app = await startLockApp({ redis: { cluster: cluster.nodes }, leaseMs: 1_500, waitMs: 5_000 });
  }, 60_000);
  afterAll(async () => {
    await app?.close();
    await cluster?.stop();
  });

  it('keeps renewing locks on the masters that answer; only the locks of the dead master are lost', async () => {
    const healthyKey = 'alive:0';
    const healthyMaster = await cluster.ownerOf(keySlot(healthyKey));
    let doomedKey = '';
    for (let i = 0; !doomedKey; i++) if ((await cluster.ownerOf(keySlot(`doomed:${i}`))) !== healthyMaster) doomedKey = `doomed:${i}`;
    const healthy = await app.locks.acquire(healthyKey);
    const doomed = await app.locks.acquire(doomedKey);
    const lost: string[] = [];
    const watching = app.locks.events$.subscribe((e) => void (e.type === 'lost' && lost.push(e.key)));
    try {
      await (await cluster.ownerOf(keySlot(doomedKey))).kill();
      // The dead master's lock is lost by its deadline ...
      expect(((await aborted(doomed.signal)) as LockLostError).reason).toBe('lease-expired');
      // ... while the other lock is renewed every half second, 6 more times: 2 leases past that.
      await nextEvents(app.locks.events$.pipe(filter((e) => e.key === healthyKey)), 'renewed', 6, 10_000);
      expect(healthy.isHeld).toBe(true);
      expect(lost).toEqual([doomedKey]);
      expect(await cluster.node(healthyMaster).hget(`lock:{${healthyKey}}`, healthy.owner)).toBe('1');
    } finally {
      watching.unsubscribe();
    }
    await healthy.release();
    expect(await cluster.node(healthyMaster).exists(`lock:{${healthyKey}}`)).toBe(0);
  }, 60_000);
});

/**
 * A Cluster whose nodes the app reaches through proxies (as behind a NAT, or in containers): either
 * the app's client translates the addresses the nodes announce (ioredis `natMap`), or each node
 * announces its proxy's address itself (`cluster-announce-port`). After each resharding of a lock's
 * slot, the app's next acquisition is refused with MOVED by the node it still sends the slot to.
 */
describe('Redis Cluster behind proxies: a MOVED redirect after a resharding', () => {
  let cluster: RedisCluster;
  const links = new Map<RedisServer, Awaited<ReturnType<typeof tcpProxy>>>();
  const apps: LockApp[] = [];

  beforeAll(async () => {
    cluster = await RedisCluster.start(3);
    for (const server of cluster.servers) links.set(server, await tcpProxy(server.port));
  });
  afterAll(async () => {
    for (const app of apps) await app.close();
    for (const link of links.values()) await link.close();
    await cluster?.stop();
  });

  /** MOVED errors every node has replied since it started. */
  async function movedReplies(): Promise<number> {
    let moved = 0;
    for (const server of cluster.servers) moved += Number(/errorstat_MOVED:count=(\d+)/.exec(String(await cluster.node(server).info('errorstats')))?.[1] ?? 0);
    return moved;
  }

  /** For each of `rounds` reshardings of the key's slot (to the next master each time): how many MOVED replies the app's next acquisition got. */
  async function redirectionsAfterResharding(app: LockApp, key: string, rounds: number): Promise<number[]> {
    const slot = keySlot(key);
    const redirections: number[] = [];
    for (let i = 0; i < rounds; i++) {
      const owner = await cluster.ownerOf(slot);
      await cluster.migrateSlot(slot, cluster.servers[(cluster.servers.indexOf(owner) + 1) % cluster.servers.length]!);
      const before = await movedReplies();
      const handle = await app.locks.acquire(key);
      redirections.push((await movedReplies()) - before);
      await handle.release();
    }
    return redirections;
  }

  it('with natMap, ioredis sends the command to a random node after MOVED named the right one; with announced ports, to the node MOVED named', async () => {
    const proxied = [...links.values()].map((l) => ({ host: '127.0.0.1', port: l.port }));
    // natMap: the client translates each node's own address into its proxy's. maxRedirections is
    // raised from 16 so that the random routing below cannot run an acquisition out of redirections.
    const natMap = Object.fromEntries([...links].map(([server, link]) => [`127.0.0.1:${server.port}`, { host: '127.0.0.1', port: link.port }]));
    const translated = await startLockApp({ redis: { cluster: proxied, options: { natMap, maxRedirections: 64 } } });
    apps.push(translated);
    const viaNatMap = await redirectionsAfterResharding(translated, 'resharded:nat', 12);
    // ioredis records the untranslated address of the MOVED reply as the slot's node, has no
    // connection by that name, and sends the command to a random master: 1 time in 3 the right one.
    // So some acquisition took more than one redirection (the chance that none of 12 did is at
    // most 1 in 3^12; an acquisition that took none, its client having refreshed its slots after
    // the migration, only lowers the count).
    expect(Math.max(...viaNatMap)).toBeGreaterThan(1);

    // Announced ports: the nodes name their proxies themselves, in CLUSTER SLOTS and in MOVED.
    await cluster.announcePorts(new Map([...links].map(([server, link]) => [server, link.port])));
    const announced = await startLockApp({ redis: { cluster: proxied } });
    apps.push(announced);
    // One redirection at most per acquisition, to the node MOVED named (and at least one redirection in all).
    expect(Math.max(...(await redirectionsAfterResharding(announced, 'resharded:announced', 12)))).toBe(1);
  });
});
