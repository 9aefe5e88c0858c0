import 'reflect-metadata';
import { describe, expect, it } from '@jest/globals';
import { Test } from '@nestjs/testing';
import { LockNotAcquiredError, LockService } from 'nestjs-locked';
import { AccountsService } from '../src/accounts.service.js';
import { AppModule } from '../src/app.module.js';

describe('nestjs-locked in a Nest 12 ESM app', () => {
  it('locks, re-enters and contends', async () => {
    const moduleRef = await Test.createTestingModule({ imports: [AppModule] }).compile();
    await moduleRef.init();
    try {
      const accounts = moduleRef.get(AccountsService);
      const locks = moduleRef.get(LockService);
      expect(await accounts.withdraw('1')).toBe(2);
      const held = await locks.acquire('account:2');
      await expect(locks.acquire('account:2', { waitMs: 0 })).rejects.toBeInstanceOf(LockNotAcquiredError);
      await held.release();
    } finally {
      await moduleRef.close();
    }
  });
});
