package service

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"strings"
)

// Parse parses args into fs, then fills every flag not given on the command line from its
// CURFEW_* environment variable.
func Parse(fs *flag.FlagSet, args []string, getenv func(string) string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %s", strings.Join(fs.Args(), " "))
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })

	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		if set[f.Name] {
			return
		}
		env := EnvName(f.Name)
		if v := getenv(env); v != "" {
			if err := fs.Set(f.Name, v); err != nil {
				errs = append(errs, fmt.Errorf("%s=%q: invalid value for --%s: %w", env, v, f.Name, err))
			}
		}
	})
	return errors.Join(errs...)
}

// EnvName returns the environment variable of a flag: --foo-bar → CURFEW_FOO_BAR.
func EnvName(flagName string) string {
	return "CURFEW_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return 0, fmt.Errorf("--log-level: %q is not one of debug, info, warn, error", s)
	}
	return l, nil
}
