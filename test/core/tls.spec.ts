import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import type { Redis } from 'ioredis';
import { LockBackendError } from '../../lib/index.js';
import { startLockApp, wokenBy } from '../support/lock-testing.js';
import { freePort, RedisServer } from '../support/redis-server.js';

/** A self-signed certificate for 127.0.0.1, made for these tests only (valid until 2126). */
const tlsDir = join(dirname(fileURLToPath(import.meta.url)), '..', 'fixtures', 'tls');
const ca = readFileSync(join(tlsDir, 'cert.pem'));

describe('Redis over TLS', () => {
  let redis: RedisServer;
  let raw: Redis;
  let tlsPort: number;
  beforeAll(async () => {
    tlsPort = await freePort();
    // The plain port stays, for the test's own inspection; the apps use the TLS port only.
    redis = await RedisServer.start([
      '--tls-port', String(tlsPort),
      '--tls-cert-file', join(tlsDir, 'cert.pem'),
      '--tls-key-file', join(tlsDir, 'key.pem'),
      '--tls-ca-cert-file', join(tlsDir, 'cert.pem'),
      '--tls-auth-clients', 'no',
    ]);
    raw = redis.client();
  });
  afterAll(async () => {
    await redis?.stop();
  });

  /** The connections made to the TLS port (Redis lists each client's local address). */
  const overTls = async () => String(await raw.client('LIST')).split('\n').filter((line) => line.includes(` laddr=127.0.0.1:${tlsPort} `)).length;

  it('locks, and wakes a waiter of another application by the release message, with ioredis tls options (the subscriber connection too)', async () => {
    const options = { redis: { host: '127.0.0.1', port: tlsPort, tls: { ca } }, leaseMs: 60_000 };
    const holders = await startLockApp(options);
    const waiters = await startLockApp(options);
    try {
      const holder = await holders.locks.acquire('tls:woken', { leaseMs: 120_000 });
      // Within 5 s of the release, with a 120 s lease: only the release message wakes the waiter.
      await wokenBy(() => holder.release(), waiters, 'tls:woken', 5_000);
      // Each application's connection, and the waiter's subscriber connection (kept for the app's life).
      expect(await overTls()).toBe(3);
      expect(await raw.exists('lock:{tls:woken}')).toBe(0);
    } finally {
      await holders.close();
      await waiters.close();
    }
  });

  it('takes a rediss:// URL as TLS with the certificate checked: bootstrap fails with LockBackendError on a certificate Node does not trust', async () => {
    const failure = await startLockApp({ redis: `rediss://127.0.0.1:${tlsPort}`, connectTimeoutMs: 2_000 }).catch((e: unknown) => e);
    expect(failure).toBeInstanceOf(LockBackendError);
    expect((failure as Error).message).toMatch(/self-signed certificate/);
  });
});
