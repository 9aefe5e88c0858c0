import { Body, Controller, Get, Inject, Param, ParseIntPipe, Post, Query } from '@nestjs/common';
import { Locked } from '../../lib/index.js';
import type { SampleOptions } from '../app.module.js';
import { SAMPLE_OPTIONS } from '../sample.constants.js';
import { AccountsService } from './accounts.service.js';

@Controller('accounts')
export class AccountsController {
  constructor(
    private readonly accounts: AccountsService,
    @Inject(SAMPLE_OPTIONS) private readonly options: SampleOptions,
  ) {}

  @Get(':id')
  async get(@Param('id') id: string) {
    return { id, balance: await this.accounts.balance(id), instance: this.options.instance };
  }

  @Post(':id/deposit')
  deposit(@Param('id') id: string, @Body('amount', ParseIntPipe) amount: number) {
    return this.accounts.deposit(id, amount);
  }

  /** Locked here (HTTP: a contended request gets 409 + Retry-After) and again in the service: the inner lock re-enters. */
  @Post(':id/withdraw')
  @Locked('account:<0>')
  withdraw(@Param('id') id: string, @Body('amount', ParseIntPipe) amount: number) {
    return this.accounts.withdraw(id, amount);
  }

  @Post(':id/audit')
  audit(@Param('id') id: string, @Query('seconds', ParseIntPipe) seconds: number) {
    return this.accounts.audit(id, seconds);
  }
}
