import 'reflect-metadata';
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { Test } from '@nestjs/testing';
import { LockNotAcquiredError, LockService } from 'nestjs-locked';
import { AccountsService } from '../src/accounts.service';
import { AppModule } from '../src/app.module';

test('nestjs-locked in a Nest 12 CommonJS app: locks, re-enters and contends', async () => {
  const moduleRef = await Test.createTestingModule({ imports: [AppModule] }).compile();
  await moduleRef.init();
  try {
    const accounts = moduleRef.get(AccountsService);
    const locks = moduleRef.get(LockService);
    assert.equal(await accounts.withdraw('1'), 2);
    const held = await locks.acquire('account:2');
    await assert.rejects(locks.acquire('account:2', { waitMs: 0 }), LockNotAcquiredError);
    await held.release();
    assert.match(require.resolve('nestjs-locked'), /dist[\\/]cjs[\\/]index\.js$/);
    // What this app proves: Nest 12 is ES modules only, and CommonJS loads it (require(esm)).
    const core = require('@nestjs/core/package.json') as { type?: string; version: string };
    assert.deepEqual([core.type, core.version.split('.')[0]], ['module', '12']);
  } finally {
    await moduleRef.close();
  }
});
