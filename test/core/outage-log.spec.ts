import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Redis } from 'ioredis';
import { OUTAGE_LOG_INTERVAL_MS, OutageLog } from '../../lib/internal/outage-log.js';
import { RedisServer } from '../support/redis-server.js';
import { gate, nextEvents, startLockApp, type LockApp } from '../support/lock-testing.js';

describe('OutageLog: a flood of one failure is logged at most once per interval', () => {
  function subject() {
    let clock = 0;
    const errors: string[] = [];
    const recoveries: string[] = [];
    const logger = { error: (m: string) => void errors.push(m), log: (m: string) => void recoveries.push(m) };
    const log = new OutageLog(logger, 'calls failed', 'calls work again', OUTAGE_LOG_INTERVAL_MS, () => clock);
    return { log, errors, recoveries, advance: (ms: number) => (clock += ms) };
  }

  it('logs the first failure, counts the rest of the interval, and logs the first one after it with that count', () => {
    const { log, errors, recoveries, advance } = subject();
    expect(log.active).toBe(false);
    log.failed('a failed');
    expect(log.active).toBe(true);
    for (let i = 0; i < 5; i++) {
      advance(OUTAGE_LOG_INTERVAL_MS / 10);
      log.failed(`b${i} failed`);
    }
    expect(errors).toEqual(['a failed']);
    advance(OUTAGE_LOG_INTERVAL_MS / 2); // the interval has passed since the first line
    log.failed('c failed');
    expect(errors).toEqual(['a failed', 'c failed (and 5 more calls failed since the previous line, not logged one by one)']);
    // Each line counts only what came after the line before it.
    advance(OUTAGE_LOG_INTERVAL_MS / 10);
    log.failed('d failed');
    advance(OUTAGE_LOG_INTERVAL_MS);
    log.failed('e failed');
    expect(errors.at(-1)).toBe('e failed (and 1 more calls failed since the previous line, not logged one by one)');
    expect(recoveries).toEqual([]);
  });

  it('says on recovery how many went unlogged after the last line, and logs the next failure at once', () => {
    const { log, errors, recoveries, advance } = subject();
    log.failed('a failed');
    log.failed('b failed');
    log.failed('c failed');
    log.recovered();
    expect(recoveries).toEqual(['calls work again; 2 more calls failed after the last line about them']);
    expect(log.active).toBe(false);
    advance(1);
    log.failed('d failed'); // a new outage, within the interval of the last line: logged at once
    expect(errors).toEqual(['a failed', 'd failed']);
  });

  it('says nothing on recovery when every failure was logged', () => {
    const { log, errors, recoveries } = subject();
    log.failed('a failed');
    log.recovered();
    log.recovered();
    expect(errors).toEqual(['a failed']);
    expect(recoveries).toEqual([]);
  });
});

describe('releases that fail in an outage', () => {
  let redis: RedisServer;
  let client: Redis;
  let app: LockApp;
  beforeAll(async () => {
    redis = await RedisServer.start();
    // A client of the application's that fails a command at once while disconnected (no retries),
    // so the releases fail as soon as the server is gone instead of after ioredis' 20 reconnections.
    client = new Redis(redis.port, '127.0.0.1', { maxRetriesPerRequest: 0 });
    client.on('error', () => undefined);
    app = await startLockApp({ redis: client, leaseMs: 5_000 });
  });
  afterAll(async () => {
    await app?.close();
    client?.disconnect();
    await redis?.stop();
  });

  it('are logged once with the first cause, and counted when a release works again', async () => {
    const { locks, logger } = app;
    const lines = (level: string) => logger.entries.filter((e) => e.level === level && e.context === 'LockService').map((e) => e.message);
    const work = gate();
    const acquired = nextEvents(locks.events$, 'acquired', 5);
    const runs = [1, 2, 3, 4, 5].map((i) => locks.run(`outage:${i}`, () => work.promise));
    await acquired;
    const failed = nextEvents(locks.events$, 'release-failed', 5);
    await redis.kill();
    work.open();
    await Promise.all(runs); // run() does not let a failed release replace the result
    await failed;
    expect(lines('error')).toHaveLength(1);
    expect(lines('error')[0]).toMatch(/^could not release "outage:\d"; its lease will free it: LockBackendError: Redis failed during release/);

    const reconnected = new Promise((resolve) => client.once('ready', resolve));
    await redis.launch();
    await reconnected;
    await locks.run('outage:after', () => undefined);
    expect(lines('log')).toEqual(['releases work again; 4 more releases failed after the last line about them']);
    expect(lines('error')).toHaveLength(1);
  });
});

describe.each([
  ['made from a URL', (redis: RedisServer) => redis.url],
  // A client passed in with ioredis's commandTimeout: lock steps run on a copy without it.
  ['copied from a client passed in', (redis: RedisServer) => new Redis(redis.port, '127.0.0.1', { commandTimeout: 5_000 }).on('error', () => undefined)],
])('errors of a connection the module opened, %s', (_how, given) => {
  let redis: RedisServer;
  let app: LockApp;
  let passed: string | Redis;
  beforeAll(async () => {
    redis = await RedisServer.start();
    passed = given(redis);
    app = await startLockApp({ redis: passed });
  });
  afterAll(async () => {
    await app?.close();
    if (passed instanceof Redis) passed.disconnect();
    await redis?.stop();
  });

  it('are logged once per message while they repeat, and once more after the connection was ready again', async () => {
    const client = (app.locks as unknown as { store: { client: Redis } }).store.client;
    const warnings = () =>
      app.logger.entries.filter((e) => e.level === 'warn' && e.context === 'LockService' && e.message.startsWith('Redis connection:')).map((e) => e.message);
    // Resolves once ioredis has failed to reconnect `n` times (the server is gone: connection refused).
    const refused = (n: number) =>
      new Promise<void>((resolve) => {
        let seen = 0;
        const on = (e: Error) => {
          if (!e.message.includes('ECONNREFUSED') || ++seen < n) return;
          client.off('error', on);
          resolve();
        };
        client.on('error', on);
      });
    let failing = refused(3);
    await redis.kill();
    await failing;
    expect(warnings().filter((m) => m.includes('ECONNREFUSED'))).toHaveLength(1);
    const ready = new Promise((resolve) => client.once('ready', resolve));
    await redis.launch();
    await ready;
    failing = refused(2);
    await redis.kill();
    await failing;
    expect(warnings().filter((m) => m.includes('ECONNREFUSED'))).toHaveLength(2);
    await redis.launch();
  });
});
