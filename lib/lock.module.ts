import { Module, type DynamicModule, type InjectionToken, type ModuleMetadata, type OptionalFactoryDependency, type Provider, type Type } from '@nestjs/common';
import { LockConfigurationError } from './errors/lock-configuration.error.js';
import { LOCK_MODULE_OPTIONS } from './lock.constants.js';
import type { LockModuleOptions } from './lock-options.js';
import { LockService } from './lock.service.js';

/** Makes the module global: `LockService` is injectable everywhere without importing `LockModule` again. */
export interface LockModuleGlobal {
  isGlobal?: boolean;
}

/** A class that builds the options, for `forRootAsync({ useClass })` and `useExisting`. */
export interface LockOptionsFactory {
  createLockOptions(): LockModuleOptions | Promise<LockModuleOptions>;
}

/** Options of `LockModule.forRootAsync()`: exactly one of `useFactory`, `useClass`, `useExisting`. */
export interface LockModuleAsyncOptions extends LockModuleGlobal, Pick<ModuleMetadata, 'imports'> {
  useFactory?: (...args: any[]) => LockModuleOptions | Promise<LockModuleOptions>;
  inject?: (InjectionToken | OptionalFactoryDependency)[];
  useClass?: Type<LockOptionsFactory>;
  useExisting?: Type<LockOptionsFactory>;
  /** More providers the factory may need. */
  extraProviders?: Provider[];
}

/**
 * The module: provides and exports `LockService`.
 *
 * @example
 * // app.module.ts
 * @Module({ imports: [LockModule.forRoot({ redis: process.env.REDIS_URL, isGlobal: true })] })
 * export class AppModule {}
 *
 * @example
 * LockModule.forRootAsync({
 *   imports: [ConfigModule],
 *   inject: [ConfigService],
 *   useFactory: (config: ConfigService) => ({ redis: config.getOrThrow('REDIS_URL') }),
 * })
 */
@Module({})
export class LockModule {
  /** Options known now. They are validated at bootstrap (a bad option fails start-up with `LockConfigurationError`). */
  static forRoot(options: LockModuleOptions & LockModuleGlobal = {}): DynamicModule {
    const { isGlobal, ...lockOptions } = options ?? {};
    return LockModule.build(isGlobal, [{ provide: LOCK_MODULE_OPTIONS, useValue: lockOptions }], []);
  }

  /** Options computed at bootstrap from other providers (configuration, secrets). */
  static forRootAsync(options: LockModuleAsyncOptions): DynamicModule {
    const ways = [options?.useFactory, options?.useClass, options?.useExisting].filter((w) => w !== undefined);
    if (ways.length !== 1) {
      throw new LockConfigurationError(
        'forRootAsync',
        `LockModule.forRootAsync() needs exactly one of useFactory, useClass or useExisting; got ${ways.length}.`,
      );
    }
    const providers: Provider[] = [...(options.extraProviders ?? [])];
    if (options.useFactory) {
      providers.push({ provide: LOCK_MODULE_OPTIONS, useFactory: options.useFactory, inject: options.inject ?? [] });
    } else {
      const factoryClass = (options.useClass ?? options.useExisting)!;
      if (options.useClass) providers.push({ provide: factoryClass, useClass: factoryClass });
      providers.push({
        provide: LOCK_MODULE_OPTIONS,
        useFactory: (factory: LockOptionsFactory) => factory.createLockOptions(),
        inject: [factoryClass],
      });
    }
    return LockModule.build(options.isGlobal, providers, options.imports ?? []);
  }

  private static build(isGlobal: boolean | undefined, providers: Provider[], imports: ModuleMetadata['imports'] & {}): DynamicModule {
    return {
      module: LockModule,
      global: isGlobal === true,
      imports,
      providers: [...providers, LockService],
      exports: [LockService],
    };
  }
}
