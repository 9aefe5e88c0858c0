import { afterAll, beforeAll, describe, expect, it } from '@jest/globals';
import { Controller, Get, Inject, Injectable, Module, Param, Scope, type INestApplication } from '@nestjs/common';
import { NestFactory, REQUEST } from '@nestjs/core';
import { Locked, LockModule, LockService } from '../../lib/index.js';
import { CapturingLogger, gate, listening } from '../support/lock-testing.js';
import { RedisServer } from '../support/redis-server.js';

// Nest makes a controller request-scoped as soon as it depends on a request-scoped provider (the
// scope bubbles up), and creates a transient provider once per consumer: @Locked receives
// LockService by property injection, which Nest must do on each of those instances too.

const instances = { request: 0, transient: 0 };
const holding = new Map<string, { entered: () => void; release: Promise<void> }>();

@Injectable({ scope: Scope.TRANSIENT })
class Ledger {
  readonly id = ++instances.transient;
  constructor(private readonly locks: LockService) {}

  @Locked('ledger:<0>')
  async post(account: string) {
    return { ledger: this.id, key: this.locks.current()?.key, holdCount: this.locks.current()?.holdCount };
  }
}

@Injectable({ scope: Scope.REQUEST })
class RequestInfo {
  constructor(@Inject(REQUEST) readonly request: { url: string }) {}
}

@Controller('accounts')
class AccountsController {
  readonly id = ++instances.request;
  constructor(
    private readonly info: RequestInfo,
    private readonly ledger: Ledger,
    private readonly locks: LockService,
  ) {}

  @Get(':id')
  @Locked('ledger:<0>')
  async get(@Param('id') id: string) {
    const wait = holding.get(id);
    if (wait) {
      wait.entered();
      await wait.release;
    }
    return { controller: this.id, url: this.info.request.url, key: this.locks.current()?.key, nested: await this.ledger.post(id) };
  }
}

describe('@Locked on request-scoped and transient instances', () => {
  let redis: RedisServer;
  let app: INestApplication;
  let url: string;

  beforeAll(async () => {
    redis = await RedisServer.start();
    @Module({ imports: [LockModule.forRoot({ redis: redis.url, waitMs: 200 })], controllers: [AccountsController], providers: [RequestInfo, Ledger] })
    class AppModule {}
    app = await NestFactory.create(AppModule, { logger: new CapturingLogger() });
    url = await listening(app);
  });
  afterAll(async () => {
    await app?.close();
    await redis?.stop();
  });

  it('locks on a new controller instance per request, and re-enters in a transient provider', async () => {
    const first = (await (await fetch(`${url}/accounts/7`)).json()) as Record<string, unknown>;
    const second = (await (await fetch(`${url}/accounts/7`)).json()) as Record<string, unknown>;
    // Two requests, two controllers (and two transient ledgers): each one had its LockService.
    expect(second.controller).not.toBe(first.controller);
    expect(first).toMatchObject({ url: '/accounts/7', key: 'ledger:7', nested: { key: 'ledger:7', holdCount: 2 } });
    expect((second.nested as { ledger: number }).ledger).not.toBe((first.nested as { ledger: number }).ledger);
  });

  it('makes two requests on different instances contend for one key: the second gets 409 while the first holds it', async () => {
    const entered = gate();
    const release = gate();
    holding.set('8', { entered: entered.open, release: release.promise });
    const first = fetch(`${url}/accounts/8`);
    await entered.promise;
    holding.delete('8');
    const second = await fetch(`${url}/accounts/8`);
    expect(second.status).toBe(409);
    expect(await second.json()).toMatchObject({ code: 'LOCK_NOT_ACQUIRED', key: 'ledger:8' });
    release.open();
    expect((await first).status).toBe(200);
    expect(await redis.shared().exists('lock:{ledger:8}')).toBe(0);
  });
});
