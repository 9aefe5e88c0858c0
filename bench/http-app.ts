// Benchmark child process: a Nest HTTP app with the same endpoint five ways: no lock, @Locked, a
// hand-written SET NX PX / compare-and-delete lock, and two that split @Locked's cost in two:
// LockService.run() inside the handler (the lock without the decorator), and LockInterceptor alone
// (the Nest interceptor that @Locked applies, without a lock). argv: redisUrl
import 'reflect-metadata';
import { Controller, Get, Module, Param, UseInterceptors } from '@nestjs/common';
import { NestFactory } from '@nestjs/core';
import { Redis } from 'ioredis';
import { randomUUID } from 'node:crypto';
import { Locked, LockInterceptor, LockModule, LockService } from '../lib/index.js';

const url = process.argv[2]!;
const redis = new Redis(url);
const CAD = `if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end`;
const sha = (await redis.script('LOAD', CAD)) as string;

@Controller()
class ItemsController {
  constructor(private readonly locks: LockService) {}

  @Get('none/:id')
  none(@Param('id') id: string) {
    return { id };
  }

  @Get('locked/:id')
  @Locked('item:<0>')
  locked(@Param('id') id: string) {
    return { id };
  }

  @Get('service/:id')
  service(@Param('id') id: string) {
    return this.locks.run(`item:${id}`, () => ({ id }));
  }

  @Get('interceptor/:id')
  @UseInterceptors(LockInterceptor)
  interceptor(@Param('id') id: string) {
    return { id };
  }

  @Get('manual/:id')
  async manual(@Param('id') id: string) {
    const token = randomUUID();
    if ((await redis.set(`manual:${id}`, token, 'PX', 30_000, 'NX')) !== 'OK') return { id, busy: true };
    try {
      return { id };
    } finally {
      await redis.evalsha(sha, 1, `manual:${id}`, token);
    }
  }
}

@Module({ imports: [LockModule.forRoot({ redis: url })], controllers: [ItemsController] })
class BenchModule {}

const app = await NestFactory.create(BenchModule, { logger: false });
await app.listen(0, '127.0.0.1');
process.send!({ type: 'listening', url: (await app.getUrl()).replace('[::1]', '127.0.0.1') });
// `cpu`: reply with this process's CPU time so far (bench:profile); anything else: stop.
process.on('message', async (message: { type?: string }) => {
  if (message?.type === 'cpu') return void process.send!({ type: 'cpu', usage: process.cpuUsage() });
  process.removeAllListeners('message');
  await app.close();
  await redis.quit();
  process.disconnect();
});
