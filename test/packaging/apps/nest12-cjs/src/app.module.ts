import { Module } from '@nestjs/common';
import { LockModule } from 'nestjs-locked';
import { AccountsService } from './accounts.service';

@Module({
  imports: [LockModule.forRoot({ redis: process.env.REDIS_URL, isGlobal: true })],
  providers: [AccountsService],
})
export class AppModule {}
