import type { Redis } from 'ioredis';
import type { AcquireManyResult, AcquireRequest, AcquireResult, LockMode, LockState, LockStore, ReleaseWatch, RenewRequest } from '../lock-store.js';
import { ReleaseWaiters } from '../../waiting/release-waiters.js';
import { withTimeout } from '../../internal/time.js';
import {
  ACQUIRE,
  ACQUIRE_FAIR,
  ACQUIRE_MANY,
  ACQUIRE_READ,
  ACQUIRE_WRITE,
  FENCE_COUNTER_TTL_MS,
  FORCE_UNLOCK,
  INSPECT,
  LEAVE_QUEUE,
  LEAVE_WRITERS,
  RELEASE,
  RELEASE_ALL,
  RELEASE_RW,
  RENEW,
} from './lock.scripts.js';
import { RedisScript } from './redis-script.js';

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
  releaseAll: new RedisScript('releaseAll', RELEASE_ALL),
  renew: new RedisScript('renew', RENEW),
  inspect: new RedisScript('inspect', INSPECT),
  forceUnlock: new RedisScript('forceUnlock', FORCE_UNLOCK),
};

/** Keys renewed per script call: big enough that 10 000 held locks cost a handful of calls, small enough not to stall Redis. */
const RENEW_BATCH = 500;

/** What the store reports about itself. */
export interface StoreLogger {
  debug(message: string): void;
  warn(message: string): void;
}

/**
 * Locks on one Redis server (or a Sentinel-managed master) through ioredis. The data model and the
 * scripts are described in `lock.scripts.ts`.
 *
 * Waiting: one extra connection per store subscribes to the release channels of the keys that
 * local waiters want, reference-counted per key; a release message wakes one local waiter.
 */
export class RedisLockStore implements LockStore {
  readonly description: string;
  private subscriber: Redis | undefined;
  private readonly waiters = new ReleaseWaiters();
  private readonly channels = new Map<string, { key: string; refs: number; ready: Promise<void> }>();
  private closed = false;

  constructor(
    private readonly client: Redis,
    private readonly ownsClient: boolean,
    private readonly prefix: string,
    private readonly log: StoreLogger,
  ) {
    const o = client.options ?? {};
    this.description = `redis ${o.path ?? `${o.host ?? '127.0.0.1'}:${o.port ?? 6379}`}`;
  }

  /** The Redis name of a lock's hash (also its release channel). */
  lockName(key: string): string {
    return `${this.prefix}{${key}}`;
  }

  async ready(timeoutMs: number): Promise<void> {
    await withTimeout(
      Promise.all(Object.values(scripts).map((s) => s.load(this.client))),
      timeoutMs,
      () => new Error(`no answer from ${this.description} within ${timeoutMs} ms`),
    );
  }

  async acquire({ key, owner, leaseMs, mode = 'exclusive', fair, queueTimeoutMs }: AcquireRequest): Promise<AcquireResult> {
    const name = this.lockName(key);
    const fence = `${name}:fence`;
    let r: number[];
    if (mode === 'read') {
      r = (await scripts.acquireRead.run(this.client, [name, fence, `${name}:writers`], [owner, leaseMs, FENCE_COUNTER_TTL_MS])) as number[];
    } else if (mode === 'write') {
      r = (await scripts.acquireWrite.run(this.client, [name, fence, `${name}:writers`], [owner, leaseMs, FENCE_COUNTER_TTL_MS, queueTimeoutMs ?? 5_000])) as number[];
    } else if (fair) {
      r = (await scripts.acquireFair.run(this.client, [name, fence, `${name}:queue`, `${name}:queue:timeouts`], [owner, leaseMs, FENCE_COUNTER_TTL_MS, queueTimeoutMs ?? 5_000])) as number[];
    } else {
      r = (await scripts.acquire.run(this.client, [name, fence], [owner, leaseMs, FENCE_COUNTER_TTL_MS])) as number[];
    }
    if (Number(r[0]) === -1) return { granted: false, ttlMs: -1, upgrade: true };
    return Number(r[0]) === 1
      ? { granted: true, holdCount: Number(r[1]), fencingToken: Number(r[2]) }
      : { granted: false, ttlMs: Number(r[1]) };
  }

  async acquireMany(keys: readonly string[], owner: string, leaseMs: number): Promise<AcquireManyResult> {
    const names = keys.flatMap((key) => {
      const name = this.lockName(key);
      return [name, `${name}:fence`];
    });
    const r = ((await scripts.acquireMany.run(this.client, names, [owner, leaseMs, FENCE_COUNTER_TTL_MS])) as unknown[]).map(Number);
    if (r[0] === 0) return { granted: false, blockedBy: keys[r[1]! - 1]!, ttlMs: r[2]! };
    const grants = keys.map((_, i) => ({ holdCount: r[1 + 2 * i]!, fencingToken: r[2 + 2 * i]! }));
    return { granted: true, grants };
  }

  async release(key: string, owner: string, mode: LockMode = 'exclusive'): Promise<number> {
    const name = this.lockName(key);
    if (mode === 'exclusive') return Number(await scripts.release.run(this.client, [name, `${name}:queue`], [owner, name, 'publish']));
    return Number(await scripts.releaseRw.run(this.client, [name], [holderField(owner, mode), name, 'publish']));
  }

  async releaseAll(key: string, owner: string, mode: LockMode = 'exclusive'): Promise<boolean> {
    const name = this.lockName(key);
    return Number(await scripts.releaseAll.run(this.client, [name, `${name}:queue`], [holderField(owner, mode), name, 'publish'])) === 1;
  }

  async renew(entries: readonly RenewRequest[]): Promise<boolean[]> {
    const calls: Promise<unknown>[] = [];
    for (let i = 0; i < entries.length; i += RENEW_BATCH) {
      const batch = entries.slice(i, i + RENEW_BATCH);
      const keys = batch.map((e) => this.lockName(e.key));
      const args = batch.flatMap((e) => [holderField(e.owner, e.mode ?? 'exclusive'), e.leaseMs]);
      calls.push(scripts.renew.run(this.client, keys, args));
    }
    const replies = (await Promise.all(calls)) as number[][];
    return replies.flat().map((r) => Number(r) === 1);
  }

  async inspect(key: string, owner: string | undefined, mode: LockMode = 'exclusive'): Promise<LockState> {
    const r = (await scripts.inspect.run(this.client, [this.lockName(key)], [owner === undefined ? '' : holderField(owner, mode)])) as number[];
    return { locked: Number(r[0]) === 1, holdCount: Number(r[1]), ttlMs: Number(r[2]) };
  }

  async forceUnlock(key: string): Promise<boolean> {
    const name = this.lockName(key);
    return Number(await scripts.forceUnlock.run(this.client, [name, `${name}:queue`], ['', name, 'publish'])) === 1;
  }

  async abandon(key: string, owner: string, mode: LockMode, fair: boolean): Promise<void> {
    const name = this.lockName(key);
    if (fair) await scripts.leaveQueue.run(this.client, [name, `${name}:queue`, `${name}:queue:timeouts`], [owner, name, 'publish']);
    if (mode === 'write') await scripts.leaveWriters.run(this.client, [`${name}:writers`], [owner]);
  }

  watch(key: string, owner: string): ReleaseWatch {
    const channel = this.lockName(key);
    let entry = this.channels.get(channel);
    if (entry) entry.refs++;
    else {
      entry = { key, refs: 1, ready: this.subscribe(channel) };
      this.channels.set(channel, entry);
    }
    return this.waiters.join(key, owner, entry.ready, () => this.unwatch(channel));
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    this.channels.clear();
    this.subscriber?.disconnect();
    this.subscriber = undefined;
    if (this.ownsClient) {
      // QUIT queues behind unanswered commands; when the server is not there, drop them instead.
      if (this.client.status !== 'ready') this.client.disconnect();
      else await withTimeout(this.client.quit(), 1_000, () => new Error('quit timed out')).catch(() => this.client.disconnect());
    }
  }

  /** Active subscriptions and local waiters, for tests and health checks. */
  get waitState(): { channels: number; waiters: number } {
    return { channels: this.channels.size, waiters: this.waiters.size };
  }

  private unwatch(channel: string): void {
    const entry = this.channels.get(channel);
    if (!entry || --entry.refs > 0) return;
    this.channels.delete(channel);
    // Later subscribes to the same channel are queued behind this one on the same connection.
    this.subscriber?.unsubscribe(channel).catch((e: unknown) => this.log.debug(`unsubscribe ${channel} failed: ${String(e)}`));
  }

  /**
   * Subscribes to one release channel. Never rejects: if the subscription fails, waiters still wake
   * when the holder's lease ends (the acquire attempt reports it), only later.
   */
  private async subscribe(channel: string): Promise<void> {
    try {
      await this.getSubscriber().subscribe(channel);
    } catch (e) {
      if (!this.closed) this.log.warn(`could not subscribe to release channel ${channel}; waiting falls back to lease-bounded retries: ${String(e)}`);
    }
  }

  private getSubscriber(): Redis {
    if (this.subscriber) return this.subscriber;
    // Our own connection: a short disconnectTimeout keeps close() from leaving a 2 s timer behind.
    const sub = this.client.duplicate({ disconnectTimeout: 100 });
    let connectedBefore = false;
    let lastError = '';
    sub.on('message', (channel: string, payload: string) => {
      const entry = this.channels.get(channel);
      if (!entry) return;
      // 'released' wakes one local waiter; an owner id (fair queue head) wakes that waiter only.
      if (payload === 'released') this.waiters.notify(entry.key);
      else if (payload === 'all') this.waiters.notifyEveryone(entry.key);
      else this.waiters.notifyOwner(entry.key, payload);
    });
    sub.on('ready', () => {
      // Releases published while we were disconnected are lost: let one waiter per key retry.
      if (connectedBefore) this.waiters.notifyAll();
      connectedBefore = true;
      lastError = '';
    });
    sub.on('error', (e: Error) => {
      if (e.message !== lastError && !this.closed) this.log.debug(`release subscriber: ${e.message}`);
      lastError = e.message;
    });
    this.subscriber = sub;
    return sub;
  }
}

/** The hash field that holds `owner`'s holds in `mode` (see lock.scripts.ts). */
function holderField(owner: string, mode: LockMode): string {
  return mode === 'read' ? `${owner}:read` : owner;
}
