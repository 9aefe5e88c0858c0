// One interface over every lock measured: nestjs-locked, the raw Redis limit, and the anchors.
import { Logger } from '@nestjs/common';
import { Redis } from 'ioredis';
import { randomUUID } from 'node:crypto';
import { Mutex } from 'redis-semaphore';
import Redlock from 'redlock';
import { Redlock as SesameRedlock } from '@sesamecare-oss/redlock';
import { LockService, type LockOptions } from '../lib/index.js';
import { batchWrites } from '../lib/store/redis/write-batching.js';
import { ACQUIRE, RELEASE } from '../lib/store/redis/lock.scripts.js';
import { scriptsPair } from './our-scripts.js';

export interface Locker {
  /** Acquires `key` (waiting as the library waits) and resolves to its release function. */
  acquire(key: string): Promise<() => Promise<void>>;
  close(): Promise<void>;
}

export type LockerKind =
  | 'nestjs-locked'
  | 'nestjs-locked-fair'
  | 'nestjs-locked-no-fencing'
  | 'scripts'
  | 'raw'
  | 'raw-batched'
  | 'redlock'
  | 'redlock-10ms'
  | 'sesame-redlock'
  | 'sesame-redlock-10ms'
  | 'redis-semaphore';

export const ANCHORS: LockerKind[] = ['redlock', 'sesame-redlock', 'redis-semaphore'];

// As an application would configure it: contention is logged at debug level, which a benchmark
// (and most production apps) does not print.
Logger.overrideLogger(['error', 'warn']);

const CAD = `if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end`;

export async function makeLocker(kind: LockerKind, url: string): Promise<Locker> {
  switch (kind) {
    case 'nestjs-locked':
    case 'nestjs-locked-fair':
    case 'nestjs-locked-no-fencing': {
      // nestjs-locked-no-fencing: with fencingTokens: false (README, "Turning tokens off").
      const locks = new LockService({ redis: url, waitMs: Infinity, ...(kind === 'nestjs-locked-no-fencing' ? { fencingTokens: false } : {}) });
      return serviceLocker(locks, { fair: kind === 'nestjs-locked-fair' });
    }
    case 'scripts':
      return scriptsLocker(url);
    case 'raw':
    case 'raw-batched': {
      // The least an owner-safe lock can do: SET NX PX, and a compare-and-delete script. Waiting is
      // a spin on SET NX with no delay: the fastest possible handoff, and the most Redis traffic.
      // raw-batched writes its commands as nestjs-locked does (one socket write per 8 commands sent
      // in one pass of the event loop), to tell that batching from the rest of the lock's cost.
      const client = new Redis(url);
      const sha = (await client.script('LOAD', CAD)) as string;
      const batch = kind === 'raw-batched' ? () => batchWrites(client) : () => undefined;
      return {
        acquire: async (key) => {
          const id = randomUUID();
          for (;;) {
            batch();
            if ((await client.set(key, id, 'PX', 10_000, 'NX')) === 'OK') break;
          }
          return async () => {
            batch();
            await client.evalsha(sha, 1, key, id);
          };
        },
        close: async () => void (await client.quit()),
      };
    }
    case 'redlock':
    case 'redlock-10ms':
      return redlockLocker(url, (client, settings) => new Redlock([client], settings), kind === 'redlock-10ms');
    case 'sesame-redlock':
    case 'sesame-redlock-10ms':
      return redlockLocker(url, (client, settings) => new SesameRedlock([client], settings), kind === 'sesame-redlock-10ms');
    case 'redis-semaphore': {
      // Its default poll interval is 10 ms already.
      const client = new Redis(url);
      return {
        acquire: async (key) => {
          for (;;) {
            const mutex = new Mutex(client, key, { lockTimeout: 10_000, acquireTimeout: 60_000, onLockLost: () => undefined });
            try {
              await mutex.acquire();
              return () => mutex.release();
            } catch {
              /* timed out: try again */
            }
          }
        },
        close: async () => void (await client.quit()),
      };
    }
  }
}

/** A LockService, started here, as a Locker: each acquisition with `options`; `closed` runs after its shutdown (a client it was given). */
export async function serviceLocker(locks: LockService, options?: LockOptions, closed?: () => Promise<unknown>): Promise<Locker> {
  await locks.onModuleInit();
  return {
    acquire: async (key) => {
      const handle = await locks.acquire(key, options);
      return () => handle.release();
    },
    close: async () => {
      await locks.onApplicationShutdown();
      await closed?.();
    },
  };
}

/**
 * `scripts`: nestjs-locked's acquire and release scripts (or a variant of them) sent from a bare
 * ioredis client, with the keys and arguments RedisLockStore gives them: a raw lock that keeps the
 * same promises (hold count, fencing token, wake-up for waiters) without LockService. For fresh keys
 * only (scenario 1 and bench:profile): it never waits.
 */
export async function scriptsLocker(url: string, acquire = ACQUIRE, release = RELEASE): Promise<Locker> {
  const client = new Redis(url);
  const pair = await scriptsPair(client, acquire, release);
  let owner = 0;
  return {
    // One call does the whole pair: the release function is then a no-op.
    acquire: async (key) => {
      await pair(key, `scripts-owner:${++owner}`);
      return async () => undefined;
    },
    close: async () => void (await client.quit()),
  };
}

/** Both redlock packages share node-redlock's API: acquire(keys, ms) -> lock.release(). */
async function redlockLocker(
  url: string,
  create: (client: Redis, settings: { retryDelay?: number; retryJitter?: number }) => { acquire(keys: string[], ms: number): Promise<{ release(): Promise<unknown> }> },
  tuned: boolean,
): Promise<Locker> {
  const client = new Redis(url);
  const redlock = create(client, tuned ? { retryDelay: 10, retryJitter: 0 } : {});
  return {
    acquire: async (key) => {
      for (;;) {
        try {
          const lock = await redlock.acquire([key], 10_000);
          return async () => void (await lock.release());
        } catch {
          /* retries exhausted under contention: try again */
        }
      }
    },
    close: async () => void (await client.quit()),
  };
}
