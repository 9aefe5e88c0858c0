import 'reflect-metadata';
import { Test } from '@nestjs/testing';
import { LockNotAcquiredError, LockService } from 'nestjs-locked';
import { AccountsService } from '../src/accounts.service';
import { AppModule } from '../src/app.module';

describe('nestjs-locked in a Nest 11 CommonJS app', () => {
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
      expect(require.resolve('nestjs-locked')).toMatch(/dist[\\/]cjs[\\/]index\.js$/);
    } finally {
      await moduleRef.close();
    }
  });
});
