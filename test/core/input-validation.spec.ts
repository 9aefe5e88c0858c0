import { readFileSync } from 'node:fs';
import { describe, expect, it } from '@jest/globals';
import type { Redis } from 'ioredis';
import { LockConfigurationError, LockKeyError, LockModule, LockService, MAX_KEY_LENGTH } from '../../lib/index.js';
import { resolveModuleOptions } from '../../lib/lock-options.js';
import type { RedisServer } from '../support/redis-server.js';
import { startLockApp, usePrivateLockApp, type LockApp } from '../support/lock-testing.js';

describe('keys and per-call options are checked before Redis is touched', () => {
  let redis: RedisServer;
  let app: LockApp;
  let raw: Redis;
  usePrivateLockApp({}, (started) => ({ redis, raw, app } = started));

  const entryPoints: [string, (locks: LockService, key: unknown) => Promise<unknown>][] = [
    ['acquire', (l, k) => l.acquire(k as string)],
    ['tryAcquire', (l, k) => l.tryAcquire(k as string)],
    ['run', (l, k) => l.run(k as string, () => 1)],
    ['isLocked', (l, k) => l.isLocked(k as string)],
    ['holdCount', (l, k) => l.holdCount(k as string)],
    ['remainingTtl', (l, k) => l.remainingTtl(k as string)],
    ['forceUnlock', (l, k) => l.forceUnlock(k as string)],
  ];
  const badKeys: [string, unknown, RegExp][] = [
    ['empty', '', /must not be empty/],
    ['a number', 42, /must be a string; got 42/],
    ['undefined', undefined, /must be a string; got undefined/],
    ['an object', { id: 1 }, /must be a string; got an object \(Object\)/],
    ['too long', 'k'.repeat(MAX_KEY_LENGTH + 1), new RegExp(`at most ${MAX_KEY_LENGTH} characters; got ${MAX_KEY_LENGTH + 1}`)],
    ['with braces', 'tenant:{7}', /contains "\{" or "\}"/],
  ];

  it.each(entryPoints.flatMap(([name, call]) => badKeys.map(([what, key, message]) => [name, what, call, key, message] as const)))(
    '%s rejects a key that is %s with LockKeyError',
    async (name, _what, call, key, message) => {
      await raw.config('RESETSTAT');
      const failure = await call(app.locks, key).then(() => new Error('accepted'), (e: unknown) => e);
      expect(failure).toBeInstanceOf(LockKeyError);
      expect((failure as Error).message).toMatch(new RegExp(`LockService\\.${name}\\(\\)`));
      expect((failure as Error).message).toMatch(message);
      expect(await raw.info('commandstats')).not.toMatch(/cmdstat_evalsha/);
    },
  );

  it('accepts a key of exactly the maximum length', async () => {
    const key = 'k'.repeat(MAX_KEY_LENGTH);
    await app.locks.run(key, async () => expect(await app.locks.isLocked(key)).toBe(true));
  });

  it.each([
    [{ waitMs: -1 }, 'waitMs', /got -1/],
    [{ waitMs: 1.5 }, 'waitMs', /got 1.5/],
    [{ leaseMs: 0 }, 'leaseMs', /from 100 .* got 0/],
    [{ leaseMs: NaN }, 'leaseMs', /got NaN/],
    [{ leaseMs: 3_000_000_000 }, 'leaseMs', /got 3000000000/],
    [{ owner: '' }, 'owner', /non-empty string/],
    [{ owner: 7 }, 'owner', /got 7/],
    [{ signal: 'stop' }, 'signal', /must be an AbortSignal/],
    [{ wait: 100 }, 'wait', /unknown option "wait"/],
    [{ leasems: 100 }, 'leasems', /did you mean "leaseMs"/],
    [null, 'options', /LockService\.acquire\(\) options must be an object; got null/],
  ])('acquire() rejects options %j with LockConfigurationError naming %s', async (options, option, message) => {
    const failure = await app.locks.acquire('opts', options as never).then(() => new Error('accepted'), (e: unknown) => e);
    expect(failure).toBeInstanceOf(LockConfigurationError);
    expect((failure as LockConfigurationError).option).toBe(option);
    expect((failure as Error).message).toMatch(message);
    expect(await app.locks.isLocked('opts')).toBe(false);
  });

  it('accepts an owner of exactly 256 characters, and keeps its holds apart from the 255-character prefix', async () => {
    const owner = 'o'.repeat(256);
    const lock = await app.locks.acquire('owner:longest', { owner });
    try {
      expect(await app.locks.holdCount('owner:longest', { owner })).toBe(1);
      expect(await app.locks.holdCount('owner:longest', { owner: owner.slice(1) })).toBe(0);
    } finally {
      await lock.release();
    }
  });

  it("takes store: 'redis', the default, when it is given: the lock is in Redis", async () => {
    const explicit = await startLockApp({ redis: redis.url, store: 'redis' });
    try {
      await explicit.locks.run('store:explicit', async () => expect(await raw.exists('lock:{store:explicit}')).toBe(1));
    } finally {
      await explicit.close();
    }
  });

  // An app that picks its store from the environment keeps its REDIS_URL when it picks 'memory'.
  it("ignores a redis given with store: 'memory': bootstraps and locks with nothing listening there", async () => {
    const memory = await startLockApp({ store: 'memory', redis: 'redis://127.0.0.1:1', connectTimeoutMs: 500 });
    try {
      await memory.locks.run('store:memory', async () => expect(await memory.locks.isLocked('store:memory')).toBe(true));
    } finally {
      await memory.close();
    }
  });

  it('accepts waitMs: Infinity and rejects waitMs on tryAcquire', async () => {
    const lock = await app.locks.acquire('inf', { waitMs: Infinity });
    await lock.release();
    await expect(app.locks.tryAcquire('inf', { waitMs: 5 } as never)).rejects.toThrow(/tryAcquire\(\) never waits/);
  });

  it('rejects a run() without a function, and extend() with a bad lease, holding nothing afterwards', async () => {
    await expect(app.locks.run('nofn', undefined as never)).rejects.toBeInstanceOf(LockConfigurationError);
    const lock = await app.locks.acquire('extend:bad');
    await expect(lock.extend(10)).rejects.toThrow(/LockHandle\.extend\(\): leaseMs must be .* got 10/);
    await expect(lock.extend(undefined as never)).rejects.toThrow(/got null/);
    await lock.release();
    await expect(lock.extend(1_000)).rejects.toThrow(/already released/);
    expect(await app.locks.isLocked('extend:bad')).toBe(false);
    expect(await app.locks.isLocked('nofn')).toBe(false);
  });

  it('extends a held lock and forceUnlock of a missing key is a no-op', async () => {
    const lock = await app.locks.acquire('extend:ok', { leaseMs: 1_000 });
    await lock.extend(20_000);
    expect(await app.locks.remainingTtl('extend:ok')).toBeGreaterThan(19_000);
    await lock.release();
    expect(await app.locks.forceUnlock('never-locked')).toBe(false);
  });
});

describe("the README's defaults", () => {
  it("are the defaults of the module options it lists, of replication's and of redlock's", () => {
    const readme = readFileSync(new URL('../../README.md', import.meta.url), 'utf8');
    const table = readme.slice(readme.indexOf('| option | default | meaning |'));
    const rows = [...table.slice(0, table.indexOf('\n\n')).matchAll(/^\| `(\w+)` \| `([^`]+)` \|/gm)].map(([, name, text]) => [name!, text!] as const);
    const parse = (text: string): unknown => (/^'.*'$/.test(text) ? text.slice(1, -1) : /^(\d+|true|false)$/.test(text) ? JSON.parse(text) : text);
    const resolved = resolveModuleOptions({}) as unknown as Record<string, unknown>;
    expect(rows.length).toBeGreaterThanOrEqual(14);
    // isGlobal is LockModule's own: whether the dynamic module it returns is global.
    const actual = (name: string) => (name === 'isGlobal' ? LockModule.forRoot({}).global : resolved[name]);
    for (const [name, text] of rows) expect([name, actual(name)]).toEqual([name, parse(text)]);
    const redlock = { clients: ['redis://127.0.0.1:1', 'redis://127.0.0.1:2', 'redis://127.0.0.1:3'] };
    expect(resolveModuleOptions({ replication: { replicas: 1 } }).replication).toEqual({ replicas: 1, timeoutMs: 100, onUnconfirmedAcquire: 'rollback' });
    expect(resolveModuleOptions({ redlock }).redlock).toEqual({ ...redlock, driftFactor: 0.01 });
    const prose = readme.replace(/\s+/g, ' ');
    expect(prose).toContain("`timeoutMs` defaults to 100 ms and `onUnconfirmedAcquire` to `'rollback'`");
    expect(prose).toContain('`driftFactor` defaults to 0.01');
  });
});
