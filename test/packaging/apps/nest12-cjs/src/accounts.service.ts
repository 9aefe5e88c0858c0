import { Injectable } from '@nestjs/common';
import { Locked, LockService } from 'nestjs-locked';

@Injectable()
export class AccountsService {
  constructor(private readonly locks: LockService) {}

  @Locked('account:<0>')
  async withdraw(id: string): Promise<number | undefined> {
    return this.audit(id);
  }

  @Locked('account:<0>')
  async audit(id: string): Promise<number | undefined> {
    return this.locks.current(`account:${id}`)?.holdCount;
  }
}
