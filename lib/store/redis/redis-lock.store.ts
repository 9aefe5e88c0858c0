import type { Cluster, Redis } from 'ioredis';
import type { AcquireManyResult, AcquireRequest, AcquireResult, Handover, HoldsHere, LockMode, LockState, LockStore, ReleaseWatch, RenewRequest, TakeAlong } from '../lock-store.js';
import { ReleaseWaiters } from '../../waiting/release-waiters.js';
import { now, realNextTick, realTime, withTimeout } from '../../internal/time.js';
import { redactUrls } from '../../internal/redact.js';
import {
  ACQUIRE,
  ACQUIRE_FAIR,
  ACQUIRE_MANY,
  ACQUIRE_READ,
  ACQUIRE_WRITE,
  ADJUST_HOLDS,
  FENCE_COUNTER_TTL_MS,
  FORCE_UNLOCK,
  HOLDERS,
  INSPECT,
  LEAVE_QUEUE,
  LEAVE_WRITERS,
  PUBLISH_CHECK,
  ACL_CHECK,
  RELEASE,
  RELEASE_TO,
  RELEASE_ALL,
  RELEASE_ALL_RW,
  RELEASE_RW,
  RENEW,
  SET_LEASE,
} from './lock.scripts.js';
import { RedisScript } from './redis-script.js';
import { LockConfigurationError } from '../../errors/lock-configuration.error.js';
import { LockReplicationError } from '../../errors/lock-replication.error.js';
import type { ReplicationOptions } from '../../lock-options.js';
import { DEFAULT_FAIR_QUEUE_TIMEOUT_MS } from '../../lock.constants.js';

const scripts = {
  acquire: new RedisScript('acquire', ACQUIRE),
  acquireFair: new RedisScript('acquireFair', ACQUIRE_FAIR),
  acquireMany: new RedisScript('acquireMany', ACQUIRE_MANY),
  acquireRead: new RedisScript('acquireRead', ACQUIRE_READ),
  acquireWrite: new RedisScript('acquireWrite', ACQUIRE_WRITE),
  releaseRw: new RedisScript('releaseRw', RELEASE_RW),
  leaveQueue: new RedisScript('leaveQueue', LEAVE_QUEUE),
  leaveWriters: new RedisScript('leaveWriters', LEAVE_WRITERS),
  release: new RedisScript('release', RELEASE),
  releaseTo: new RedisScript('releaseTo', RELEASE_TO),
  releaseAll: new RedisScript('releaseAll', RELEASE_ALL),
  releaseAllRw: new RedisScript('releaseAllRw', RELEASE_ALL_RW),
  renew: new RedisScript('renew', RENEW),
  setLease: new RedisScript('setLease', SET_LEASE),
  inspect: new RedisScript('inspect', INSPECT),
  holders: new RedisScript('holders', HOLDERS),
  forceUnlock: new RedisScript('forceUnlock', FORCE_UNLOCK),
  adjustHolds: new RedisScript('adjustHolds', ADJUST_HOLDS),
  publishCheck: new RedisScript('publishCheck', PUBLISH_CHECK),
  aclCheck: new RedisScript('aclCheck', ACL_CHECK),
};

/** Keys renewed per script call: big enough that 10 000 held locks cost a handful of calls, small enough not to stall Redis. */
const RENEW_BATCH = 500;

/** How often `forceUnlock` reads the holders of a lock whose holders keep changing before it deletes it regardless. */
const FORCE_UNLOCK_LOOKS = 5;

/** A single server (or a Sentinel-managed master) or a Redis Cluster. */
export type RedisClient = Redis | Cluster;

/** What the store reports about itself. */
export interface StoreLogger {
  debug(message: string): void;
  warn(message: string): void;
}

/**
 * Locks on one Redis server, a Sentinel-managed master, or a Redis Cluster, through ioredis. The
 * data model and the scripts are described in `lock.scripts.ts`.
 *
 * Waiting: one extra connection per store subscribes to the release channels of the keys that
 * local waiters want, reference-counted per key; a release message wakes one local waiter. On a
 * Cluster of Redis 7 or later, releases are announced with sharded pub/sub (SPUBLISH to the lock's
 * own slot, SSUBSCRIBE on the node that serves it) instead of being broadcast to every node.
 */
export class RedisLockStore implements LockStore {
  readonly description: string;
  private subscriber: RedisClient | undefined;
  private readonly waiters = new ReleaseWaiters();
  private readonly channels = new Map<string, { key: string; refs: number; ready: Promise<boolean> }>();
  /** Channels whose last waiter left, to unsubscribe on the next turn of the event loop (see unwatch). */
  private readonly unsubscribeSoon = new Set<string>();
  private unsubscribeScheduled = false;
  private closed = false;
  private readonly cluster: boolean;
  /** How releases are announced: `spublish` once a Cluster is known to support sharded pub/sub. */
  private publish: 'publish' | 'spublish' = 'publish';
  /** Set once the server refused `WAIT`: replica confirmation is then skipped. */
  private waitRefused = false;
  /** The `WAIT` the steps confirmed since the last one was sent share (see confirm). */
  private nextWait: Promise<number | undefined> | undefined;
  /** The `WAIT` sent and not yet answered, if any (see confirm). */
  private waitInFlight: Promise<unknown> | undefined;
  /** The counter lifetime the non-fair grant scripts get: `0` when they issue no tokens. */
  private readonly grantFenceTtlMs: number;
  /** How often the lock connection (on a Cluster, any node's) has closed so far: see `resent`. */
  private closes = 0;
  private readonly connectionClosed = (): void => {
    this.closes++;
  };
  private readonly nodeAdded = (node: Redis): void => {
    node.on('close', this.connectionClosed);
  };
  /**
   * The steps of each holder field of each lock in flight (keyed by `stepKey`): twice their number,
   * plus 1 once two of them were in flight together (a number, not an object: this runs on every
   * step). See `countedTwice`.
   */
  private readonly inFlight = new Map<string, number>();

  constructor(
    private readonly client: RedisClient,
    private readonly ownsClient: boolean,
    private readonly prefix: string,
    private readonly log: StoreLogger,
    private readonly replication?: Required<ReplicationOptions>,
    /** How long a fencing counter outlives its key's last grant (`fencingCounterTtlMs`); 0 keeps none (tokens are then 0: Redlock's nodes). */
    private readonly fenceTtlMs: number = FENCE_COUNTER_TTL_MS,
    /**
     * False (`fencingTokens: false`): plain, read, write and multi-key grants keep no counter and
     * issue token 0 (their scripts then skip TIME and the counter). Fair locks keep theirs: a
     * waiter tells a stale handover from a fresh one by its token.
     */
    issueTokens = true,
  ) {
    this.grantFenceTtlMs = issueTokens ? fenceTtlMs : 0;
    this.cluster = (client as { isCluster?: boolean }).isCluster === true;
    if (this.cluster) {
      (client as Cluster).on('+node', this.nodeAdded);
      for (const node of (client as Cluster).nodes()) this.nodeAdded(node);
      const nodes = ((client as unknown as { startupNodes?: unknown[] }).startupNodes ?? []).map(describeNode);
      this.description = `redis cluster ${nodes.join(',')}`;
    } else {
      client.on('close', this.connectionClosed);
      const o = (client as Redis).options ?? {};
      this.description = o.sentinels?.length
        ? `redis sentinel master "${o.name}" (${o.sentinels.map(describeNode).join(',')})`
        : `redis ${o.path ?? `${o.host ?? '127.0.0.1'}:${o.port ?? 6379}`}`;
    }
  }

  /** See LockStore.confirmMs: a WAIT ahead of the step's own, each up to the replication timeout. */
  get confirmMs(): number {
    return this.replication ? 2 * this.replication.timeoutMs : 0;
  }

  /** The Redis name of a lock's hash (also its release channel). */
  lockName(key: string): string {
    return `${this.prefix}{${key}}`;
  }

  async ready(timeoutMs: number): Promise<void> {
    // ioredis reports why it cannot connect (a refused password, an untrusted certificate) only as
    // 'error' events, and keeps trying: the bootstrap error passes the last one on.
    let lastError: string | undefined;
    const failed = (e: Error) => (lastError = e.message);
    this.client.on('error', failed);
    try {
      await withTimeout(this.prepare(), timeoutMs, () => new Error(`no answer from ${this.description} within ${timeoutMs} ms${lastError === undefined ? '' : `; the connection failed with: ${lastError}${readyCheckHint(lastError)}`}`));
    } finally {
      this.client.off('error', failed);
    }
  }

  /**
   * Whether `acquireMany` can take these keys in one step: always on one server; on a Cluster only
   * when every key hashes to the same slot (else LockService takes them one by one).
   */
  groupsAtomically(keys: readonly string[]): boolean {
    if (!this.cluster) return true;
    const slot = keySlot(keys[0]!);
    return keys.every((key) => keySlot(key) === slot);
  }

  /** A client created with lazyConnect (ours are) starts connecting; failures come as 'error' events. */
  connect(): void {
    if (this.client.status === 'wait') this.client.connect().catch(() => undefined);
  }

  private async prepare(): Promise<void> {
    // Connected and ready before the first command: a client with enableOfflineQueue: false would
    // refuse a command sent earlier ("Stream isn't writeable"), and a lazy Cluster never connects
    // on its own.
    const client = this.client;
    if (client.status === 'end' && !this.ownsClient) {
      // A client passed in that its application closed (quit(), disconnect()) never connects again:
      // waiting for it would end at the bootstrap deadline with "no answer".
      throw new LockConfigurationError(
        'redis',
        `the ioredis client passed in for ${this.description} was closed (quit() or disconnect()), and ioredis does not reopen a closed client. Pass an open client, or a URL or options for nestjs-locked to connect itself.`,
      );
    }
    this.connect();
    if (client.status !== 'ready') await this.connected();
    if (!this.cluster) {
      // The checks go out with the loads, on the same connection and in that order: before any
      // lock step, and the publish check's script is loaded by then.
      // The role on every ready(), health() included: a master demoted behind the application's back.
      await Promise.all([...Object.values(scripts).map((s) => s.load(client as Redis)), ...this.bootstrapChecks([client as Redis]), this.checkRole(client as Redis)]);
      return;
    }
    const cluster = client as Cluster;
    const masters = cluster.nodes('master');
    await Promise.all(masters.flatMap((node) => Object.values(scripts).map((s) => s.load(node))));
    // Sharded pub/sub (Redis 7): announce each release on its lock's own shard only.
    const info = String(await masters[0]!.info('server'));
    const major = Number(/redis_version:(\d+)/.exec(info)?.[1] ?? 0);
    if (major >= 7 && this.channels.size === 0) this.publish = 'spublish';
    await Promise.all(this.bootstrapChecks(masters));
  }

  /**
   * Resolves once the client is ready; rejects if its connection ends for good first. Every
   * ready() waiting meanwhile shares one wait, so a health probe every few seconds during an outage
   * adds no listener of its own to the client (each probe gives up after its timeout; the wait
   * stays until the connection is back).
   */
  private connected(): Promise<void> {
    const client = this.client;
    this.connecting ??= new Promise<void>((resolve, reject) => {
      const onReady = () => {
        client.off('end', onEnd);
        resolve();
      };
      const onEnd = () => {
        client.off('ready', onReady);
        reject(new Error(`the connection to ${this.description} ended`));
      };
      client.once('ready', onReady);
      client.once('end', onEnd);
    }).finally(() => (this.connecting = undefined));
    return this.connecting;
  }

  /** The wait connected() shares, while the client is not ready. */
  private connecting: Promise<void> | undefined;

  /**
   * Refuses a Redis older than the scripts need: fencing tokens use SET ... GET, new in Redis 6.2,
   * and on an older one every fresh acquisition would fail with a script error. An INFO refused
   * (an ACL) is let through.
   */
  private async checkVersion(node: Redis): Promise<void> {
    const info = await this.info(node, 'server');
    const version = info === undefined ? null : /^redis_version:(\d+)\.(\d+)\S*/m.exec(info);
    if (!version || Number(version[1]) > 6 || (Number(version[1]) === 6 && Number(version[2]) >= 2)) return;
    throw new LockConfigurationError(
      'redis',
      `${this.nodeName(node)} runs Redis ${version[0].slice('redis_version:'.length)}; nestjs-locked needs Redis 6.2 or later (its scripts use SET ... GET, new in 6.2). Upgrade Redis, or point the redis option at a newer one.`,
    );
  }

  /** INFO `section` of `node` for the bootstrap checks, or undefined (logged at debug) when Redis refuses it (an ACL). */
  private async info(node: Redis, section: string): Promise<string | undefined> {
    try {
      return String(await node.info(section));
    } catch (error) {
      this.log.debug(`could not read INFO ${section} of ${this.nodeName(node)}: ${String(error)}`);
      return undefined;
    }
  }

  /** How the bootstrap checks name one server: the store, and on a Cluster which master. */
  private nodeName(node: Redis): string {
    return this.cluster ? `${this.description} (master ${node.options.host}:${node.options.port})` : this.description;
  }

  /** Whether the first ready() made the bootstrap checks (health() calls ready() again). */
  private checked = false;

  /** Once, at the first ready(): what the application should be told (see checkPublish, checkEviction). */
  private bootstrapChecks(masters: Redis[]): Promise<void>[] {
    if (this.checked) return [];
    this.checked = true;
    return [this.checkPublish(), this.checkAcl(), ...masters.flatMap((node) => [this.checkVersion(node), this.checkEviction(node)])];
  }

  /**
   * Refuses a Redis user whose scripts may not run the commands they call on the lock names (an
   * ACL with other key patterns, or without a category they need): it could load the scripts, and
   * every acquisition would then fail with "The user executing the script can't run this command".
   * Redis 7 and later (an older one has no `redis.acl_check_cmd`); a check that fails otherwise is
   * let through.
   */
  private async checkAcl(): Promise<void> {
    let refused: unknown;
    try {
      refused = await scripts.aclCheck.run(this.client, [this.lockName('nestjs-locked:acl-check')], []);
    } catch (error) {
      // Redis checks a script's KEYS against the user's key patterns before it runs it.
      if (!/NOPERM.*key/i.test(String(error))) {
        this.log.debug(`could not check the Redis user's permissions on ${this.description}: ${String(error)}`);
        return;
      }
      refused = ['any command'];
    }
    if (!Array.isArray(refused) || refused.length === 0) return;
    throw new LockConfigurationError(
      'redis',
      `${this.description}: this connection's Redis user may not run ${refused.map(String).join(', ')} on the lock names (${this.prefix}*), which the lock scripts call, so every acquisition would fail. ` +
        `Allow them, for example ACL SETUSER <user> ~${this.prefix}* +@read +@write +time (or see the README's rule for a user limited to the locks).`,
    );
  }

  /**
   * Refuses a replica named as the server that holds the locks (at bootstrap), or one it has become
   * (health()): every lock step writes, which a read-only replica refuses (READONLY, on every
   * acquisition) and a writable one keeps to itself, unseen by its master and the other
   * applications. One server only: Sentinel is left alone (ioredis asks the sentinels for the master
   * and checks it, and a failover in progress is theirs to finish). INFO refused (an ACL) is let through.
   */
  private async checkRole(node: Redis): Promise<void> {
    if ((node.options.sentinels?.length ?? 0) > 0) return;
    const info = await this.info(node, 'replication');
    if (info === undefined || !/^role:slave\b/m.test(info)) return;
    const master = `${/^master_host:(\S+)/m.exec(info)?.[1] ?? '?'}:${/^master_port:(\d+)/m.exec(info)?.[1] ?? '?'}`;
    throw new LockConfigurationError(
      'redis',
      `${this.nodeName(node)} is a replica of ${master}: every lock step writes, which a read-only replica refuses (READONLY) and a writable one keeps to itself, unseen by its master. ` +
        'Point redis at the master, or give Sentinel options (sentinels, name) to follow failovers.',
    );
  }

  /**
   * Whether Redis may evict lock keys: with a `maxmemory` and any policy but `noeviction`, memory
   * pressure can delete a held lock (its key has an expiry, so `volatile-*` policies pick it too),
   * and another owner then takes it while its holder still works. Managed Redis services often
   * default to `volatile-lru`. Warns; INFO refused (an ACL) says nothing.
   */
  private async checkEviction(node: Redis): Promise<void> {
    const info = await this.info(node, 'memory');
    if (info === undefined) return;
    const maxmemory = Number(/^maxmemory:(\d+)/m.exec(info)?.[1] ?? 0);
    const policy = /^maxmemory_policy:(\S+)/m.exec(info)?.[1];
    if (maxmemory === 0 || !policy || policy === 'noeviction') return;
    this.log.warn(
      `${this.nodeName(node)} may evict lock keys: maxmemory is ${maxmemory} bytes with maxmemory-policy ${policy}. Under memory pressure Redis can delete a held lock (lock keys have an expiry, so volatile-* policies choose them too), and another owner can then take it while its holder still works; the holder is told at its next renewal. ` +
        `Set maxmemory-policy noeviction on the Redis that holds the locks (a full Redis then refuses writes instead, and acquisitions fail with LockBackendError), or give the locks a Redis of their own.`,
    );
  }

  /**
   * Whether this connection's Redis user may publish on the lock channels. An
   * ACL user may not unless granted them (Redis 7 creates users with no channels). Locks still
   * work then (the scripts publish with pcall), but a release cannot wake the waiters of other
   * processes, which retry only when the lease they were told of runs out: say so, and how to
   * allow them. A check that fails for another reason says nothing (the steps themselves report it).
   */
  private async checkPublish(): Promise<void> {
    const channel = this.lockName('nestjs-locked:publish-check');
    try {
      await scripts.publishCheck.run(this.client, [channel], [this.publish, channel]);
    } catch (error) {
      const text = error instanceof Error ? error.message : String(error);
      const acl = /NOPERM|channel/i.test(text);
      // Anything but Redis's own refusal (a connection that dropped meanwhile) says nothing about publishing.
      if (!acl && (error as Error | undefined)?.name !== 'ReplyError') {
        this.log.debug(`could not check that releases may publish on ${this.description}: ${text}`);
        return;
      }
      this.log.warn(
        `${this.description} refused a publish on a lock channel (${text.split('\n')[0]}). Locks still work, but a release cannot wake waiters: those of other processes retry only when the holder's lease (as they last saw it) runs out. ` +
          (acl
            ? `Allow this connection's Redis user the lock channels, for example ACL SETUSER <user> &${this.prefix}* (Redis 7 and later, and Valkey, give users created with ACL SETUSER no channels unless acl-pubsub-default is allchannels).`
            : `Give the locks a Redis that lets scripts run ${this.publish.toUpperCase()} (it is renamed or disabled here, or a proxy in between does not pass it on).`),
      );
    }
  }

  /** The KEYS of the scripts that may free a lock and hand it to the next fair waiter (see lock.scripts.ts). */
  private freeingKeys(name: string): string[] {
    return [name, `${name}:queue`];
  }

  async acquire({ key, owner, leaseMs, mode = 'exclusive', fair, queueTimeoutMs, handoverLeaseMs, waitId, holdsHere }: AcquireRequest): Promise<AcquireResult> {
    const name = this.lockName(key);
    const fence = `${name}:fence`;
    const sentAt = this.closes;
    const field = holderField(owner, mode);
    const step = stepKey(name, field);
    this.stepSent(step);
    let overlapped: boolean;
    let r: number[];
    try {
      if (mode === 'read') {
        r = (await scripts.acquireRead.run(this.client, [name, fence, `${name}:writers`], [owner, leaseMs, this.grantFenceTtlMs])) as number[];
      } else if (mode === 'write') {
        r = (await scripts.acquireWrite.run(this.client, [name, fence, `${name}:writers`], [owner, leaseMs, this.grantFenceTtlMs, queueTimeoutMs ?? DEFAULT_FAIR_QUEUE_TIMEOUT_MS])) as number[];
      } else if (fair) {
        const queueTimeout = queueTimeoutMs ?? DEFAULT_FAIR_QUEUE_TIMEOUT_MS;
        r = (await scripts.acquireFair.run(
          this.client,
          [name, fence, `${name}:queue`, `${name}:queue:timeouts`, `${name}:queue:leases`],
          [owner, leaseMs, this.fenceTtlMs, queueTimeout, handoverLeaseMs ?? Math.min(leaseMs, queueTimeout), name, this.publish, waitId ?? ''],
        )) as number[];
      } else {
        r = (await scripts.acquire.run(this.client, [name, fence], [owner, leaseMs, this.grantFenceTtlMs])) as number[];
      }
    } finally {
      overlapped = this.stepAnswered(step);
    }
    if (Number(r[0]) === -1) return { granted: false, ttlMs: -1, upgrade: true };
    if (Number(r[0]) !== 1) return r.length > 2 ? { granted: false, ttlMs: Number(r[1]), lastToken: Number(r[2]) } : { granted: false, ttlMs: Number(r[1]) };
    let holdCount = Number(r[1]);
    if (this.resent(sentAt) && !overlapped) holdCount = await this.countedTwice(name, field, holdCount, holdsHere?.(owner, key, mode));
    if (this.replication) await this.confirmGrants(key, [{ key, holdCount }], owner, mode);
    return { granted: true, holdCount, fencingToken: Number(r[2]) };
  }

  /**
   * Replica confirmation of a grant: waits for the replicas; if too few acknowledged a fresh grant
   * (a re-entry changes no ownership), gives it back and throws LockReplicationError, or keeps it
   * with a warning (`onUnconfirmedAcquire: 'keep'`).
   */
  private async confirmGrants(what: string, grants: { key: string; holdCount: number }[], owner: string, mode: LockMode): Promise<void> {
    const acknowledged = await this.confirm();
    const { replicas, timeoutMs, onUnconfirmedAcquire } = this.replication!;
    if (acknowledged === undefined || acknowledged >= replicas) return;
    const fresh = grants.filter((g) => g.holdCount === 1);
    if (fresh.length === 0) return;
    if (onUnconfirmedAcquire === 'keep') {
      this.log.warn(`lock "${what}": only ${acknowledged} of ${replicas} replica(s) acknowledged the grant within ${timeoutMs} ms; kept (onUnconfirmedAcquire: 'keep')`);
      return;
    }
    await Promise.all(fresh.map((g) => this.releaseAll(g.key, owner, mode)));
    throw new LockReplicationError(what, acknowledged, replicas, timeoutMs);
  }

  /**
   * Waits for the replicas to have every write this connection made so far, the caller's step
   * included. Steps share one `WAIT replicas timeoutMs` (a WAIT covers every earlier write of its
   * connection, and blocks the connection until it returns): with no WAIT unanswered, it is sent
   * once this turn's promise callbacks have run; while one is unanswered, every step confirmed
   * meanwhile, whichever read its reply came in, shares the one sent when that WAIT returns. So
   * a step waits for at most the WAIT in flight and one more, however many steps there are and
   * however their replies are split (see LockStore.confirmMs). Undefined without replication, or
   * once the server refused WAIT (some managed services do): that is logged once and replication
   * is skipped from then on.
   */
  private confirm(): Promise<number | undefined> {
    if (!this.replication || this.waitRefused) return Promise.resolve(undefined);
    this.nextWait ??= new Promise<number | undefined>((resolve, reject) => {
      const send = (): void => {
        this.nextWait = undefined;
        const sent = this.waitForReplicas();
        this.waitInFlight = sent;
        const answered = (): void => {
          if (this.waitInFlight === sent) this.waitInFlight = undefined;
        };
        sent.then(answered, answered);
        sent.then(resolve, reject);
      };
      // Queued behind an unanswered WAIT, a second one would only wait for it on the connection;
      // sent when it returns, it covers every step confirmed until then.
      if (this.waitInFlight) this.waitInFlight.then(send, send);
      else realNextTick(send);
    });
    return this.nextWait;
  }

  private async waitForReplicas(): Promise<number | undefined> {
    if (!this.replication || this.waitRefused) return undefined;
    try {
      return Number(await (this.client as Redis).wait(this.replication.replicas, this.replication.timeoutMs));
    } catch (error) {
      // A reply error (unknown or renamed command, no permission) is a refusal; a connection error is not.
      if (!(error instanceof Error) || error.name !== 'ReplyError') throw error;
      this.waitRefused = true;
      this.log.warn(`${this.description} refused WAIT (${error.message}); replica confirmation is off from now on, locks work without it`);
      return undefined;
    }
  }

  /** After a release or renewal: waits for the replicas, and only notes a shortfall (the master's state stands). */
  private async confirmQuietly(what: string): Promise<void> {
    const acknowledged = await this.confirm();
    if (acknowledged !== undefined && acknowledged < this.replication!.replicas) {
      this.log.debug(`${what}: ${acknowledged} of ${this.replication!.replicas} replica(s) acknowledged within ${this.replication!.timeoutMs} ms`);
    }
  }

  async acquireMany(keys: readonly string[], owner: string, leaseMs: number, holdsHere?: HoldsHere): Promise<AcquireManyResult> {
    const locks = keys.map((key) => this.lockName(key));
    const names = locks.flatMap((name) => [name, `${name}:fence`]);
    const sentAt = this.closes;
    const steps = locks.map((name) => stepKey(name, owner));
    for (const step of steps) this.stepSent(step);
    let overlapped: boolean[];
    let r: number[];
    try {
      r = ((await scripts.acquireMany.run(this.client, names, [owner, leaseMs, this.grantFenceTtlMs])) as unknown[]).map(Number);
    } finally {
      overlapped = steps.map((step) => this.stepAnswered(step));
    }
    if (r[0] === 0) return { granted: false, blockedBy: keys[r[1]! - 1]!, ttlMs: r[2]! };
    const grants = keys.map((_, i) => ({ holdCount: r[1 + 2 * i]!, fencingToken: r[2 + 2 * i]! }));
    if (this.resent(sentAt)) {
      await Promise.all(
        grants.map(async (g, i) => {
          if (!overlapped[i]) g.holdCount = await this.countedTwice(locks[i]!, owner, g.holdCount, holdsHere?.(owner, keys[i]!, 'exclusive'));
        }),
      );
    }
    if (this.replication) await this.confirmGrants(keys.join(', '), keys.map((key, i) => ({ key, holdCount: grants[i]!.holdCount })), owner, 'exclusive');
    return { granted: true, grants };
  }

  async release(key: string, owner: string, mode: LockMode = 'exclusive', takeAlong?: TakeAlong, holdsHere?: HoldsHere, stillHeld = false): Promise<number> {
    const name = this.lockName(key);
    const sentAt = this.closes;
    const field = holderField(owner, mode);
    const step = stepKey(name, field);
    this.stepSent(step);
    let left: number;
    try {
      if (mode === 'exclusive') {
        // A waiter of this process taken along: handed the lock inside the release when it frees it,
        // else its attempt leaves in the same write, right behind.
        const along = takeAlong ? this.waiters.wakeBehindRelease(key) : undefined;
        let sent: Promise<unknown>;
        if (along?.leaseMs !== undefined) {
          const leaseStart = now();
          sent = scripts.releaseTo.run(this.client, this.freeingKeys(name), [owner, name, this.publish, this.fenceTtlMs, along.owner, along.leaseMs, this.grantFenceTtlMs]);
          const handover = sent
            .then(
              // A reply from a second run cannot tell whether the first one handed the lock over.
              (reply): Handover | undefined =>
                this.resent(sentAt) ? 'unknown' : Array.isArray(reply) && reply.length === 2 ? { fencingToken: Number(reply[1]), leaseStart } : undefined,
              () => 'unknown' as const,
            )
            .then((verdict) => takeAlong!.noticed.then(() => verdict));
          // Not there to take it (never so far: nothing runs between the two calls): give it back.
          if (!along.wake(handover)) void handover.then((h) => h && this.releaseAll(key, along.owner)).catch(() => undefined);
        } else {
          sent = scripts.release.run(this.client, this.freeingKeys(name), stillHeld ? [owner, name, this.publish, this.fenceTtlMs, 1] : [owner, name, this.publish, this.fenceTtlMs], along !== undefined);
          along?.wake();
        }
        const reply = await sent;
        if (Array.isArray(reply) && reply.length === 2) left = 0;
        else if (Array.isArray(reply)) {
          // Handed to a fair waiter: if it waits in this process, it need not wait for the message.
          this.granted(key, String(reply[3]), String(reply[2]), Number(reply[1]));
          left = 0;
        } else left = Number(reply);
      } else {
        left = Number(await scripts.releaseRw.run(this.client, [name], [field, name, this.publish, stillHeld ? 1 : 0]));
      }
    } finally {
      this.stepAnswered(step);
    }
    if (this.resent(sentAt)) left = await this.droppedTwice(name, field, left, holdsHere?.(owner, key, mode));
    if (this.replication && left >= 0) await this.confirmQuietly(`release of "${key}"`);
    return left;
  }

  /**
   * Whether the reply to a command sent when `closes` was `sentAt` may come from its second run:
   * the connection closed while the command was in flight, and ioredis sends unanswered commands
   * again once it has reconnected (`autoResendUnfulfilledCommands`, on by default), although Redis
   * may have run them before the connection closed.
   */
  private resent(sentAt: number): boolean {
    return this.closes !== sentAt;
  }

  /** A step of one holder field of a lock (`stepKey`) is sent (see `inFlight`). */
  private stepSent(step: string): void {
    const entry = this.inFlight.get(step);
    this.inFlight.set(step, entry === undefined ? 2 : (entry + 2) | 1);
  }

  /**
   * A step of one holder field of a lock (`stepKey`) is answered: whether another step of that field
   * was in flight together with it (the mark stays while any step of the field is in flight, so a
   * step sent after one that overlapped others, while they are in flight, overlaps too).
   */
  private stepAnswered(step: string): boolean {
    const entry = this.inFlight.get(step)!;
    if (entry < 4) this.inFlight.delete(step);
    else this.inFlight.set(step, entry - 2);
    return (entry & 1) === 1;
  }

  /**
   * An acquisition whose reply may come from a second run (see `resent`) reports `holdCount`; the
   * caller had `before` holds (undefined: it cannot know). Any hold beyond `before + 1` is the
   * first run's (other processes do not share the owner, and earlier steps of this connection have
   * all answered): one is given back. Not called for a step that was in flight together with
   * another step of the same holder field (`inFlight`): Redis's count then also holds the other
   * steps' first runs, or not, and this process's count may not have caught up with their replies,
   * so a hold given back could be one that is held. The lock then keeps a hold too many, and
   * outlives its last release until its lease ends, rather than one too few, which would free it
   * under a holder. Steps of other fields (other owners, or the read side of this one) do not count:
   * no step changes another field's holds, except a release that hands a free lock over, which sets
   * the new holder's field to 1 where it had none; an attempt of that holder then reads 1 (taking the
   * grant) unless it ran twice (tested in dropped-reply.spec: a fair waiter's attempt that took the
   * grant of a release in flight with it).
   */
  private async countedTwice(name: string, field: string, holdCount: number, before: number | undefined): Promise<number> {
    if (before === undefined || holdCount <= before + 1) return holdCount;
    const after = Number(await scripts.adjustHolds.run(this.client, [name], [field, -1, holdCount]));
    this.log.debug(`"${name}": an acquisition sent again after the connection closed had run twice; one hold given back`);
    return after < 0 ? holdCount : holdCount - 1;
  }

  /**
   * A release whose reply may come from a second run (see `resent`) reports `left`; the caller
   * expects `after` (undefined: it cannot know). A release that had already dropped the owner's last hold finds nothing (-1):
   * released. One that dropped two holds gets one back, unless the second run freed the lock: then
   * another owner may have taken it since, and the lock counts as lost (-1); a caller that still
   * holds the lock passes `stillHeld` to `release`, so its release keeps the last hold instead.
   */
  private async droppedTwice(name: string, field: string, left: number, after: number | undefined): Promise<number> {
    if (after === undefined) return left;
    if (left < 0) return after === 0 ? 0 : -1;
    if (left >= after) return left;
    if (left === 0) return -1;
    const restored = Number(await scripts.adjustHolds.run(this.client, [name], [field, 1, left]));
    this.log.debug(`"${name}": a release sent again after the connection closed had run twice; one hold taken back`);
    return restored === -1 ? -1 : restored === -2 ? left : left + 1;
  }

  /**
   * Takes `owner`'s holds of `key` in `mode` from `from` down to `to` (Redlock: a node that counts
   * holds this process has released, see RedlockStore.acquire). Only while no step of that holder
   * field is in flight here, whose run could still change the count, and only if Redis still counts
   * `from` (adjustHolds): never below 1, so it never frees the lock. True when Redis counts `to` after it.
   */
  async trimHolds(key: string, owner: string, mode: LockMode, from: number, to: number): Promise<boolean> {
    const name = this.lockName(key);
    const field = holderField(owner, mode);
    if (to < 1 || from <= to || this.inFlight.has(stepKey(name, field))) return false;
    const left = Number(await scripts.adjustHolds.run(this.client, [name], [field, to - from, from]));
    if (left === to) this.log.debug(`"${name}": ${from - to} hold(s) given back that a late grant counted after their release`);
    return left === to;
  }

  async releaseAll(key: string, owner: string, mode: LockMode = 'exclusive'): Promise<boolean> {
    const name = this.lockName(key);
    const dropped =
      mode === 'exclusive'
        ? Number(await scripts.releaseAll.run(this.client, this.freeingKeys(name), [owner, name, this.publish, this.fenceTtlMs])) === 1
        : Number(await scripts.releaseAllRw.run(this.client, [name], [holderField(owner, mode), name, this.publish])) === 1;
    if (this.replication && dropped) await this.confirmQuietly(`release of "${key}"`);
    return dropped;
  }

  renewalGroup(key: string): number {
    return this.cluster ? keySlot(key) : 0;
  }

  async renew(entries: readonly RenewRequest[]): Promise<boolean[]> {
    // One script call per batch; on a Cluster a batch holds keys of one slot only, and the leases
    // set exactly (extend()) go in batches of their own.
    const groups = new Map<number, number[]>();
    entries.forEach((e, i) => {
      const group = 2 * this.renewalGroup(e.key) + (e.exact ? 1 : 0);
      const indexes = groups.get(group);
      if (indexes) indexes.push(i);
      else groups.set(group, [i]);
    });
    const results = new Array<boolean>(entries.length);
    const calls: Promise<void>[] = [];
    for (const indexes of groups.values()) {
      const exact = entries[indexes[0]!]!.exact === true;
      const script = exact ? scripts.setLease : scripts.renew;
      for (let i = 0; i < indexes.length; i += RENEW_BATCH) {
        const batch = indexes.slice(i, i + RENEW_BATCH);
        const keys = batch.map((j) => this.lockName(entries[j]!.key));
        const field = (j: number) => holderField(entries[j]!.owner, entries[j]!.mode ?? 'exclusive');
        // SET_LEASE also names each lock's channel (KEYS carry the client's keyPrefix, channels do not).
        const args = exact
          ? [this.publish, ...batch.flatMap((j, k) => [field(j), entries[j]!.leaseMs, keys[k]!, entries[j]!.holdsAtMost ?? -1])]
          : batch.flatMap((j) => [field(j), entries[j]!.leaseMs]);
        calls.push(
          script.run(this.client, keys, args).then((reply) => {
            (reply as number[]).forEach((r, k) => (results[batch[k]!] = Number(r) === 1));
          }),
        );
      }
    }
    await Promise.all(calls);
    if (this.replication) await this.confirmQuietly(`renewal of ${entries.length} lock(s)`);
    return results;
  }

  async inspect(key: string, owner: string | undefined, mode: LockMode = 'exclusive'): Promise<LockState> {
    const r = (await scripts.inspect.run(this.client, [this.lockName(key)], [owner === undefined ? '' : holderField(owner, mode)])) as number[];
    return { locked: Number(r[0]) === 1, holdCount: Number(r[1]), ttlMs: Number(r[2]) };
  }

  /**
   * Deletes the lock whose holders were read just before (FORCE_UNLOCK with the hash fields seen), so
   * that a second run of the script after a dropped connection cannot delete a lock another owner
   * took meanwhile. While the holders keep changing under it, it looks again, up to
   * FORCE_UNLOCK_LOOKS times, then deletes whatever holds the lock.
   */
  async forceUnlock(key: string): Promise<boolean> {
    const name = this.lockName(key);
    for (let look = 1; ; look++) {
      const checked = look < FORCE_UNLOCK_LOOKS;
      const fields = checked ? ((await scripts.holders.run(this.client, [name], [])) as string[]) : [];
      if (checked && fields.length === 0) return false;
      const sentAt = this.closes;
      const result = Number(await scripts.forceUnlock.run(this.client, this.freeingKeys(name), ['', name, this.publish, this.fenceTtlMs, checked ? '1' : '0', ...fields]));
      if (result === 1) return true;
      // Sent again after a dropped connection: the first run may have deleted the lock it was
      // given, and the second found it gone (0) or held by someone else (-1). Either way the lock
      // seen is gone, and the one there now is not to be touched.
      if (this.resent(sentAt)) return true;
      if (result === 0) return false;
    }
  }

  async abandon(key: string, owner: string, mode: LockMode, fair: boolean, waitId = ''): Promise<void> {
    const name = this.lockName(key);
    if (fair) await scripts.leaveQueue.run(this.client, this.freeingKeys(name), [owner, name, this.publish, this.fenceTtlMs, waitId]);
    if (mode === 'write') await scripts.leaveWriters.run(this.client, [`${name}:writers`, name], [owner, name, this.publish]);
  }

  watch(key: string, owner: string, handoverLeaseMs?: number): ReleaseWatch {
    const channel = this.lockName(key);
    let entry = this.channels.get(channel);
    if (entry) entry.refs++;
    else {
      entry = { key, refs: 1, ready: this.subscribe(channel) };
      this.channels.set(channel, entry);
    }
    // With replica confirmation a grant waits for WAIT and may be given back: such waits attempt themselves.
    return this.waiters.join(key, owner, entry.ready, () => this.unwatch(channel), this.replication ? undefined : handoverLeaseMs);
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    this.channels.clear();
    if (this.subscriber) endConnection(this.subscriber);
    this.subscriber = undefined;
    if (this.cluster) {
      (this.client as Cluster).off('+node', this.nodeAdded);
      for (const node of (this.client as Cluster).nodes()) node.off('close', this.connectionClosed);
    } else this.client.off('close', this.connectionClosed);
    if (this.ownsClient) {
      // QUIT queues behind unanswered commands; when the server is not there, drop them instead.
      if (this.client.status !== 'ready') endConnection(this.client);
      else await withTimeout(this.client.quit(), 1_000, () => new Error('quit timed out')).catch(() => endConnection(this.client));
    }
  }

  /**
   * A fair release handed `key` to `owner`'s wait `waitId`. With replica confirmation that waiter
   * is only woken: its next attempt takes the grant over and waits for the replicas like any grant.
   */
  private granted(key: string, owner: string, waitId: string, token: number): void {
    if (this.replication) this.waiters.notifyOwner(key, owner);
    else this.waiters.grant(key, owner, waitId, token);
  }

  /** Channels watched by local waiters, and the waiters, for tests and health checks. */
  get waitState(): { channels: number; waiters: number } {
    let channels = 0;
    for (const entry of this.channels.values()) if (entry.refs > 0) channels++;
    return { channels, waiters: this.waiters.size };
  }

  /**
   * The last waiter of a channel left. The channel is unsubscribed on the next turn of the event
   * loop at the earliest (once its SUBSCRIBE has been answered), off the path of the waiter that
   * just got its lock (sending the command took it ~80 us here); a waiter that comes before then
   * keeps the subscription, and needs no new SUBSCRIBE.
   */
  private unwatch(channel: string): void {
    const entry = this.channels.get(channel);
    if (!entry || --entry.refs > 0) return;
    this.unsubscribeSoon.add(channel);
    if (this.unsubscribeScheduled) return;
    this.unsubscribeScheduled = true;
    realTime.setImmediate(() => this.unsubscribeIdle());
  }

  private unsubscribeIdle(): void {
    this.unsubscribeScheduled = false;
    const candidates = [...this.unsubscribeSoon].flatMap((channel) => {
      const entry = this.channels.get(channel);
      return entry?.refs === 0 ? [{ channel, entry }] : [];
    });
    this.unsubscribeSoon.clear();
    if (candidates.length === 0) return;
    // Not before their SUBSCRIBE has been answered: ioredis 5 was seen to send an UNSUBSCRIBE ahead
    // of a SUBSCRIBE still waiting for a new subscriber connection to be ready, which left the
    // channel subscribed for good. A waiter that comes meanwhile keeps its channel (and entry).
    void Promise.all(candidates.map((c) => c.entry.ready)).then(() => {
      const idle = candidates.filter((c) => this.channels.get(c.channel) === c.entry && c.entry.refs === 0).map((c) => c.channel);
      for (const channel of idle) this.channels.delete(channel);
      // Later subscribes to the same channels are queued behind this on the same connection.
      const sub = this.subscriber;
      if (!sub || this.closed || idle.length === 0) return;
      const failed = (e: unknown) => this.log.debug(`unsubscribe ${idle.join(', ')} failed: ${String(e)}`);
      // Sharded channels of different slots cannot share one SUNSUBSCRIBE.
      if (this.publish === 'spublish') for (const channel of idle) sub.sunsubscribe(channel).catch(failed);
      else sub.unsubscribe(...idle).catch(failed);
    });
  }

  /**
   * Subscribes to one release channel; true once subscribed. Never rejects: if the subscription
   * fails (false), waiters still wake when the holder's lease ends (the acquire attempt reports
   * it), only later.
   */
  private async subscribe(channel: string): Promise<boolean> {
    try {
      const sub = this.getSubscriber();
      if (this.publish === 'spublish') await sub.ssubscribe(channel);
      else await sub.subscribe(channel);
      return true;
    } catch (e) {
      if (!this.closed) this.log.warn(`could not subscribe to release channel ${channel}; waiting falls back to lease-bounded retries: ${String(e)}`);
      return false;
    }
  }

  /**
   * Subscribes a reconnected subscriber to every channel that has an entry again. Never rejects: if
   * it fails (the connection dropped again, or Redis refused it: a warning; the next 'ready' tries
   * again), waiters still wake when the holder's lease ends.
   */
  private async resubscribe(sub: RedisClient): Promise<void> {
    const channels = [...this.channels.keys()];
    if (channels.length === 0 || this.closed) return;
    try {
      await (sub as Redis).subscribe(...channels);
    } catch (e) {
      if (!this.closed && this.subscriber === sub) this.log.warn(`could not resubscribe to ${channels.length} release channel(s) after a reconnect; waiting falls back to lease-bounded retries until the next one: ${String(e)}`);
    }
  }

  private getSubscriber(): RedisClient {
    if (this.subscriber) return this.subscriber;
    // Our own connection: a short disconnectTimeout keeps close() from leaving a 2 s timer behind.
    const sub = this.cluster
      ? (this.client as Cluster).duplicate([], {
          shardedSubscribers: this.publish === 'spublish',
          // Its SUBSCRIBEs wait until it is ready, whatever the application's Cluster says (ioredis
          // keeps the offline queue of the node and subscriber connections on in any case).
          enableOfflineQueue: true,
          // No keyPrefix (see PUBSUB_OPTIONS), neither its own nor the one ioredis copies from redisOptions.
          ...PUBSUB_OPTIONS,
          redisOptions: { ...(this.client as Cluster).options.redisOptions, disconnectTimeout: 100, ...PUBSUB_OPTIONS },
        })
      : // Resubscribed by us on reconnect (see 'ready' below), not by ioredis: its own resubscription
        // (every release up to 5.11.1 and 6.0.0) leaves a rejection unhandled when the connection
        // closes before Redis answers, as at shutdown during a reconnect, and Node ends the process on it.
        // Its SUBSCRIBE waits for the connection even when the application's client refuses
        // commands while disconnected (enableOfflineQueue: false).
        (this.client as Redis).duplicate({ disconnectTimeout: 100, autoResubscribe: false, enableOfflineQueue: true, ...PUBSUB_OPTIONS });
    let connectedBefore = false;
    let lastError = '';
    const onMessage = (channel: string, payload: string) => {
      const entry = this.channels.get(channel);
      if (!entry) return;
      // 'released' wakes one local waiter, 'all' every one; 'granted <token> <wait id> <owner>'
      // hands a fair lock to that wait.
      if (payload === 'released') this.waiters.notify(entry.key);
      else if (payload === 'all') this.waiters.notifyEveryone(entry.key);
      else if (payload.startsWith('granted ')) {
        const [, token, waitId] = payload.split(' ', 3) as [string, string, string];
        // The owner is the rest of the message (it may contain spaces).
        this.granted(entry.key, payload.slice(`granted ${token} ${waitId} `.length), waitId, Number(token));
      }
    };
    sub.on('message', onMessage);
    sub.on('smessage', onMessage);
    sub.on('ready', () => {
      lastError = '';
      if (!connectedBefore) {
        connectedBefore = true;
        return;
      }
      // Releases published while we were disconnected are lost: let one waiter per key retry, once
      // the channels are watched again (a Cluster's subscriber resubscribes itself).
      if (this.cluster) this.waiters.notifyAll();
      else void this.resubscribe(sub).then(() => this.waiters.notifyAll());
    });
    sub.on('error', (e: Error) => {
      if (e.message !== lastError && !this.closed) this.log.debug(`release subscriber: ${e.message}`);
      lastError = e.message;
    });
    this.subscriber = sub;
    return sub;
  }
}

/**
 * The subscriber's connection has no ioredis keyPrefix: it listens on the channels the scripts
 * publish to, which are the lock names without the client's prefix (see lock.scripts.ts). ioredis
 * counts a shard channel as a key, so on a Cluster a prefix would move every SSUBSCRIBE to a
 * channel nobody publishes to (a plain SUBSCRIBE is never prefixed).
 */
const PUBSUB_OPTIONS = { keyPrefix: undefined };

/**
 * Disconnects a connection the store owns. A socket ended during its TLS handshake can report two
 * errors: the certificate Node refuses, then the server's alert to the handshake cut short. ioredis
 * listens for the first only, so the second was an uncaught exception that ended the process. What
 * a socket being closed says is of no use any more: it is heard and dropped.
 */
function endConnection(client: RedisClient): void {
  const connections = client.isCluster ? (client as Cluster).nodes() : [client as Redis];
  // Before the first connect() a client has no socket yet.
  for (const connection of connections) (connection.stream as Redis['stream'] | undefined)?.on('error', () => undefined);
  client.disconnect();
}

/**
 * What `inFlight` counts steps by: a lock's name and one holder field. A name ends with the closing
 * brace of its hash tag and no key contains a brace, so different pairs never join to the same string.
 */
function stepKey(name: string, field: string): string {
  return name + field;
}

/** The hash field that holds `owner`'s holds in `mode` (see lock.scripts.ts). */
function holderField(owner: string, mode: LockMode): string {
  return mode === 'read' ? `${owner}:read` : owner;
}

/**
 * ioredis's ready check sends INFO, and keeps failing the connection on a Redis that has no INFO
 * (renamed or disabled; an ACL's NOPERM ioredis lets through): say how to turn the check off.
 */
function readyCheckHint(error: string): string {
  return /unknown command [`'"]?info\b/i.test(error)
    ? '. ioredis checks that a connection is ready with INFO, which this Redis does not have (renamed or disabled): give ioredis options with enableReadyCheck: false'
    : '';
}

function describeNode(node: unknown): string {
  if (typeof node === 'string' || typeof node === 'number') return redactUrls(String(node));
  const n = node as { host?: string; port?: number };
  return `${n.host ?? '127.0.0.1'}:${n.port ?? 6379}`;
}

/** The Cluster hash slot of a lock: every Redis name of it carries the hash tag `{key}`. */
export function keySlot(key: string): number {
  return crc16(Buffer.from(key)) % 16_384;
}

/** CRC-16/XMODEM, the checksum Redis Cluster hashes keys with. */
function crc16(bytes: Uint8Array): number {
  let crc = 0;
  for (const byte of bytes) {
    crc ^= byte << 8;
    for (let i = 0; i < 8; i++) crc = crc & 0x8000 ? ((crc << 1) ^ 0x1021) & 0xffff : (crc << 1) & 0xffff;
  }
  return crc;
}
