package cli

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// APIKeyEnv names the environment variable the client commands read an API key from.
// The key is sent as `authorization: Bearer <key>` and names the tenant the commands act
// for. It is never taken as a flag, which other users could read in the process list.
const APIKeyEnv = "CURFEW_API_KEY" //nolint:gosec // the variable's name, not a credential

// CLIKeyFile is the file under the data directory where `curfew up --insecure` keeps the
// API key of tenant "default" its CLI uses: without mTLS the CLI is not a mesh peer, so
// it authenticates like any other caller.
const CLIKeyFile = "cli.key"

// apiKey returns the API key the client commands send: $CURFEW_API_KEY, else, over
// plaintext, the key `curfew up --insecure` left in DIR/cli.key; "" for none (the CLI
// then calls as the mesh peer curfew-cli, which needs mTLS).
func (c *common) apiKey(plaintext bool) (string, error) {
	if k := strings.TrimSpace(os.Getenv(APIKeyEnv)); k != "" {
		if _, _, err := apikey.Parse(k); err != nil {
			return "", fmt.Errorf("$%s is not a curfew API key (cfk_…): curfew tenant create makes one", APIKeyEnv)
		}
		return k, nil
	}
	if !plaintext {
		return "", nil
	}
	b, err := os.ReadFile(filepath.Join(c.dataDir, CLIKeyFile))
	if errors.Is(err, fs.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(b)), nil
}

// prepareCLIKey makes sure DIR/cli.key holds a valid API key of tenant "default" in the
// store at dsn, for the CLI of a plaintext mesh: the key there is kept while the store
// still accepts it, else a new one is made (other keys of the tenant are left alone).
func prepareCLIKey(ctx context.Context, dsn, dataDir string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	st, err := store.Open(ctx, dsn)
	if err != nil {
		return err
	}
	defer func() { _ = st.Close() }()
	path := filepath.Join(dataDir, CLIKeyFile)
	if b, err := os.ReadFile(path); err == nil { //nolint:gosec // DIR/cli.key in the data directory the user names
		if id, _, err := apikey.Parse(strings.TrimSpace(string(b))); err == nil {
			if rec, err := st.GetAPIKey(ctx, id); err == nil && !rec.Revoked() && rec.Tenant == md.DefaultTenant {
				return nil
			}
		}
	}
	k, err := apikey.New(md.DefaultTenant)
	if err != nil {
		return err
	}
	if _, _, err := st.CreateAPIKey(ctx, k.Record, false); err != nil {
		return err
	}
	_ = os.Remove(path) // a file of another mode is not reused: WriteFile keeps the mode
	return os.WriteFile(path, []byte(k.Secret+"\n"), 0o600)
}

// The web console's files in the data directory.
const (
	consoleSecretFile = "console.secret"
	consoleTokenFile  = "console.token"
)

// prepareConsole makes sure DIR/console.secret holds the console's session secret (made
// once, 0600) and writes a new one-time sign-in token to DIR/console.token, which it
// returns.
func prepareConsole(dataDir string) (string, error) {
	secret := filepath.Join(dataDir, consoleSecretFile)
	if b, err := os.ReadFile(secret); err != nil || len(strings.TrimSpace(string(b))) < 32 { //nolint:gosec // in the data directory the user names
		_ = os.Remove(secret)
		if err := os.WriteFile(secret, []byte(randomToken(48)+"\n"), 0o600); err != nil {
			return "", err
		}
	}
	token := randomToken(24)
	path := filepath.Join(dataDir, consoleTokenFile)
	_ = os.Remove(path)
	return token, os.WriteFile(path, []byte(token+"\n"), 0o600)
}

// randomToken is n random bytes, URL-safe base64.
func randomToken(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return base64.RawURLEncoding.EncodeToString(b)
}
