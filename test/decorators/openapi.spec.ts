import { describe, expect, it } from '@jest/globals';
import { Body, Controller, Get, Module, Param, ParseIntPipe, Post, Query, type INestApplication } from '@nestjs/common';
import { ROUTE_ARGS_METADATA } from '@nestjs/common/constants.js';
import { NestFactory } from '@nestjs/core';
import { ApiProperty, DocumentBuilder, SwaggerModule, type OpenAPIObject } from '@nestjs/swagger';
import { Locked, LockModule } from '../../lib/index.js';
import { CapturingLogger } from '../support/lock-testing.js';

class WithdrawDto {
  @ApiProperty()
  amount!: number;
}

/**
 * The same controller with and without `@Locked`: the OpenAPI document must not tell them apart.
 * Each kind of handler @Locked treats differently: parameter decorators (the call-site parameter
 * is added after them), a route without parameters with @Locked above the route decorator (added
 * as the only one) and below it (LockInterceptor instead).
 */
function accountsController(locked: boolean) {
  const lock = (key: string): MethodDecorator => (locked ? Locked(key) : () => undefined);
  @Controller('accounts')
  class AccountsController {
    @Post(':id/withdraw')
    @lock('account:<0>')
    withdraw(@Param('id', ParseIntPipe) id: number, @Body() body: WithdrawDto) {
      return { id, amount: body.amount };
    }

    @lock('account:<0>')
    @Get(':id')
    balance(@Param('id') id: string, @Query('currency') currency: string) {
      return { id, currency };
    }

    @lock('accounts:audit')
    @Post('audit')
    audit() {
      return 'audited';
    }

    @Post('close-day')
    @lock('accounts:close-day')
    closeDay() {
      return 'closed';
    }
  }
  return AccountsController;
}

async function documentOf(controller: new () => object): Promise<OpenAPIObject> {
  @Module({ imports: [LockModule.forRoot({ store: 'memory' })], controllers: [controller] })
  class AppModule {}
  const app: INestApplication = await NestFactory.create(AppModule, { logger: new CapturingLogger() });
  try {
    await app.init();
    return SwaggerModule.createDocument(app, new DocumentBuilder().setTitle('accounts').build());
  } finally {
    await app.close();
  }
}

describe('@Locked handlers in the OpenAPI document of @nestjs/swagger', () => {
  it('documents a @Locked controller exactly as the same controller without @Locked: the parameter @Locked adds does not show', async () => {
    const [Locked_, Plain] = [accountsController(true), accountsController(false)];
    // The locked controller does declare one more parameter where the document could show it.
    for (const method of ['withdraw', 'balance', 'audit'] as const) {
      const declared = (c: object) => Object.keys(Reflect.getMetadata(ROUTE_ARGS_METADATA, c, method) ?? {}).length;
      expect([method, declared(Locked_)]).toEqual([method, declared(Plain) + 1]);
    }
    const [locked, plain] = await Promise.all([documentOf(Locked_), documentOf(Plain)]);
    expect(locked).toEqual(plain);
    // And the document is the one the controller asks for.
    expect(Object.keys(plain.paths).sort()).toEqual(['/accounts/audit', '/accounts/close-day', '/accounts/{id}', '/accounts/{id}/withdraw']);
    expect(plain.paths['/accounts/{id}']!.get!.parameters).toEqual([
      expect.objectContaining({ name: 'id', in: 'path' }),
      expect.objectContaining({ name: 'currency', in: 'query' }),
    ]);
    expect(plain.paths['/accounts/{id}/withdraw']!.post!.parameters).toEqual([expect.objectContaining({ name: 'id', in: 'path' })]);
    expect(plain.paths['/accounts/{id}/withdraw']!.post!.requestBody).toEqual(expect.objectContaining({ content: { 'application/json': { schema: { $ref: '#/components/schemas/WithdrawDto' } } } }));
    expect(plain.paths['/accounts/audit']!.post!.parameters).toEqual([]);
  });
});
