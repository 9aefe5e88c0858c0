import { Module, type DynamicModule, type InjectionToken, type ModuleMetadata, type OptionalFactoryDependency, type Provider, type Type } from '@nestjs/common';
import { LockConfigurationError } from './errors/lock-configuration.error.js';
import { LOCK_MODULE_OPTIONS } from './lock.constants.js';
import { bool, describe, isOptionsObject, type LockModuleOptions } from './lock-options.js';
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

/** The ways of `forRootAsync()` to build the options, of which exactly one is given. */
const WAYS = ['useFactory', 'useClass', 'useExisting'] as const;

/** The lists `forRootAsync()` takes, each with what it holds. */
const LISTS = [
  ['imports', 'of the modules the options need'],
  ['inject', 'of the providers useFactory takes, in its parameters\' order'],
  ['extraProviders', 'of providers'],
] as const;

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
  /**
   * Options known now. They are validated at bootstrap (a bad option fails start-up with
   * `LockConfigurationError`); options that are not an object, and an `isGlobal` that is not a
   * boolean, are refused here, where the module is declared.
   */
  static forRoot(options: LockModuleOptions & LockModuleGlobal = {}): DynamicModule {
    assertOptionsObject(options, 'LockModule.forRoot()');
    const { isGlobal, ...lockOptions } = options ?? {};
    return LockModule.build('LockModule.forRoot()', isGlobal, [{ provide: LOCK_MODULE_OPTIONS, useValue: lockOptions }], []);
  }

  /** Options computed at bootstrap from other providers (configuration, secrets). */
  static forRootAsync(options: LockModuleAsyncOptions): DynamicModule {
    const ways = WAYS.filter((way) => options?.[way] !== undefined);
    if (ways.length !== 1) {
      throw new LockConfigurationError(
        'forRootAsync',
        `LockModule.forRootAsync() needs exactly one of useFactory, useClass or useExisting; got ${ways.length}.`,
      );
    }
    const way = ways[0]!;
    if (typeof options[way] !== 'function') {
      throw new LockConfigurationError(
        'forRootAsync',
        `LockModule.forRootAsync(): ${way} must be ${way === 'useFactory' ? 'a function that returns the options' : 'a class that implements LockOptionsFactory'}; got ${describe(options[way])}.`,
      );
    }
    // Nest reads a single class given as inject as no injection at all (the factory gets undefined).
    for (const [list, what] of LISTS) {
      if (options[list] !== undefined && !Array.isArray(options[list])) {
        throw new LockConfigurationError('forRootAsync', `LockModule.forRootAsync(): ${list} must be an array ${what}; got ${describe(options[list])}.`);
      }
    }
    const providers: Provider[] = [...(options.extraProviders ?? [])];
    const useFactory = options.useFactory;
    if (useFactory) {
      providers.push({
        provide: LOCK_MODULE_OPTIONS,
        useFactory: async (...args: unknown[]) => produced(await useFactory(...args), 'useFactory'),
        inject: options.inject ?? [],
      });
    } else {
      const factoryClass = (options.useClass ?? options.useExisting)!;
      if (options.useClass) providers.push({ provide: factoryClass, useClass: factoryClass });
      providers.push({
        provide: LOCK_MODULE_OPTIONS,
        useFactory: async (factory: LockOptionsFactory) => produced(await factory.createLockOptions(), `${factoryClass.name}.createLockOptions()`),
        inject: [factoryClass],
      });
    }
    return LockModule.build('LockModule.forRootAsync()', options.isGlobal, providers, options.imports ?? []);
  }

  private static build(where: string, isGlobal: unknown, providers: Provider[], imports: ModuleMetadata['imports'] & {}): DynamicModule {
    return {
      module: LockModule,
      // Anything but a boolean (an environment variable's "false", say) is refused, not read one way or the other.
      global: bool(isGlobal, 'isGlobal', where, false),
      imports,
      providers: [...providers, LockService],
      exports: [LockService],
    };
  }
}

/**
 * What a `forRootAsync()` factory returned, refused when it is no options at all: a configuration
 * key that is not set (`config.get('lock')`) or braces without parentheses (`() => { redis: url }`)
 * give `undefined`, which would start on every default, the local Redis included. `{}` asks for
 * every default. Anything else is checked at bootstrap with every other option.
 */
function produced(options: LockModuleOptions | null | undefined, by: string): LockModuleOptions {
  if (options === undefined || options === null) {
    throw new LockConfigurationError(
      'forRootAsync',
      `LockModule.forRootAsync(): ${by} returned ${String(options)}; it must return the options object ({} for every default). A configuration key that is not set gives undefined, and so does an arrow function with braces but no parentheses (write () => ({ redis: url })).`,
    );
  }
  return options;
}

/**
 * @internal Refuses options that are not an object, where the module is declared: spread into the
 * module's options, an array or a string would lose what makes it wrong (`[]` would start with every
 * default, `[{ leaseMs }]` fail at bootstrap with `unknown option "0"`). `null` reads as no options.
 */
export function assertOptionsObject(options: unknown, where: string): void {
  if (options !== null && !isOptionsObject(options)) {
    throw new LockConfigurationError('options', `${where} takes an options object; got ${describe(options)}.`);
  }
}
