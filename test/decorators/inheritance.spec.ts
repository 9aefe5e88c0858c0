import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Injectable } from '@nestjs/common';
import { Test, type TestingModule } from '@nestjs/testing';
import { Locked, LockModule, LockNotAcquiredError, LockService } from '../../lib/index.js';
import { CapturingLogger } from '../support/lock-testing.js';
import { RedisServer } from '../support/redis-server.js';

// A base class whose methods carry @Locked, and providers that extend it: what a team writes for a
// family of jobs or repositories. The subclasses are the providers Nest creates; the decorator ran
// on the base class only (or on both, for an override).

abstract class Job {
  constructor(readonly locks: LockService) {}
  abstract readonly name: string;

  @Locked('job:<0>', { waitMs: 0 })
  async run(id: string): Promise<Record<string, unknown>> {
    return { job: this.name, key: this.locks.current()?.key, holdCount: this.locks.current()?.holdCount, inner: await this.step(id) };
  }

  @Locked('job:<0>:step')
  async step(id: string) {
    return { key: this.locks.current()?.key };
  }
}

@Injectable()
class Invoices extends Job {
  readonly name = 'invoices';
  constructor(locks: LockService) {
    super(locks);
  }
}

@Injectable()
class Reports extends Job {
  readonly name = 'reports';
  constructor(locks: LockService) {
    super(locks);
  }

  // An override with a lock of its own around the base class's locked method.
  @Locked('reports:<0>')
  override async run(id: string): Promise<Record<string, unknown>> {
    return { outer: this.locks.current()?.key, base: await super.run(id) };
  }

  // A method of the subclass only: the subclass declares the injection too.
  @Locked('reports:<0>:extra')
  async extra(id: string) {
    return { key: this.locks.current()?.key };
  }
}

describe('@Locked on methods of a base class', () => {
  let redis: RedisServer;
  let moduleRef: TestingModule;

  beforeAll(async () => {
    redis = await RedisServer.start();
    moduleRef = await Test.createTestingModule({ imports: [LockModule.forRoot({ redis: redis.url })], providers: [Invoices, Reports] })
      .setLogger(new CapturingLogger())
      .compile();
    await moduleRef.init();
  });
  afterAll(async () => {
    await moduleRef?.close();
    await redis?.stop();
  });

  it('locks an inherited method on each subclass, nested locked calls included', async () => {
    await expect(moduleRef.get(Invoices).run('1')).resolves.toEqual({ job: 'invoices', key: 'job:1', holdCount: 1, inner: { key: 'job:1:step' } });
    await expect(moduleRef.get(Reports).run('2')).resolves.toEqual({
      outer: 'reports:2',
      base: { job: 'reports', key: 'job:2', holdCount: 1, inner: { key: 'job:2:step' } },
    });
    await expect(moduleRef.get(Reports).extra('3')).resolves.toEqual({ key: 'reports:3:extra' });
    expect(await redis.shared().keys('lock:{*}')).toEqual([]);
  });

  it("keeps the base class's options and key: two subclasses contend for one key", async () => {
    const held = await moduleRef.get(LockService).acquire('job:4');
    // waitMs: 0 from the base class's decorator: fails at once.
    await expect(moduleRef.get(Invoices).run('4')).rejects.toBeInstanceOf(LockNotAcquiredError);
    await expect(moduleRef.get(Reports).run('4')).rejects.toBeInstanceOf(LockNotAcquiredError);
    await held.release();
    await expect(moduleRef.get(Invoices).run('4')).resolves.toMatchObject({ key: 'job:4' });
  });

  it('names the class that declares the decorator in its errors', async () => {
    await expect(moduleRef.get(Invoices).run(undefined as never)).rejects.toThrow(/^@Locked on Job\.run: .*argument <0> is undefined/);
  });
});
