package meshtls

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"time"
)

// CA is the mesh's certificate authority: an ECDSA P-256 key and self-signed
// certificate, kept in a directory as ca.key and ca.crt, that issue the mesh identities'
// certificates. ca.crt may hold more certificates than the CA's own: the CAs still
// trusted during a rotation (see RotateCA).
type CA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	// trusted is ca.crt's contents: cert and, during a rotation, the previous CAs.
	trusted []*x509.Certificate
}

// Certificate returns the CA's certificate.
func (ca *CA) Certificate() *x509.Certificate { return ca.cert }

// EnsureCA loads the CA in dir (ca.crt and ca.key), or creates one valid for
// DefaultCAValidity when neither file exists, creating dir (0700) if needed. The key is
// written 0600, the certificate 0644. A directory holding only one of the two files is
// an error: it is never overwritten.
func EnsureCA(dir string) (*CA, error) {
	_, kerr := os.Stat(filepath.Join(dir, CAKeyFile))
	_, cerr := os.Stat(filepath.Join(dir, CACertFile))
	switch {
	case kerr == nil && cerr == nil:
		return loadCA(dir)
	case errors.Is(kerr, fs.ErrNotExist) && errors.Is(cerr, fs.ErrNotExist):
	case kerr != nil && !errors.Is(kerr, fs.ErrNotExist):
		return nil, fmt.Errorf("meshtls: %w", kerr)
	case cerr != nil && !errors.Is(cerr, fs.ErrNotExist):
		return nil, fmt.Errorf("meshtls: %w", cerr)
	default:
		return nil, fmt.Errorf("meshtls: %s holds only one of %s and %s; remove it to create a new CA", dir, CACertFile, CAKeyFile)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("meshtls: %w", err)
	}
	ca, err := newCA(DefaultCAValidity)
	if err != nil {
		return nil, err
	}
	if err := ca.write(dir); err != nil {
		return nil, err
	}
	return ca, nil
}

// RotateCA begins a rotation of the CA in dir: it creates a new CA, valid for
// DefaultCAValidity, and writes its key as ca.key and, as ca.crt, its certificate
// followed by those of the previous ca.crt not yet expired, so that the mesh trusts
// both while the services' certificates are re-issued. It returns the new CA. A rotation
// takes three steps, each visible to every process one reload interval after it (see the
// package doc):
//
//  1. RotateCA; wait more than the reload interval, until every process trusts the new CA;
//  2. Issue every identity's certificate with the new CA; wait more than the interval;
//  3. FinishRotation: ca.crt holds the new CA only, and the old one is no longer trusted.
func RotateCA(dir string) (*CA, error) {
	old, err := loadCA(dir)
	if err != nil {
		return nil, err
	}
	ca, err := newCA(DefaultCAValidity)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	for _, c := range old.trusted {
		if now.Before(c.NotAfter) {
			ca.trusted = append(ca.trusted, c)
		}
	}
	// ca.crt first: until ca.key is replaced, the old key still finds its certificate in
	// the bundle, so a failure in between leaves a usable CA.
	if err := writeFileAtomic(filepath.Join(dir, CACertFile), ca.bundlePEM(), 0o644); err != nil {
		return nil, err
	}
	if err := writeKey(filepath.Join(dir, CAKeyFile), ca.key); err != nil {
		return nil, err
	}
	return ca, nil
}

// FinishRotation ends a rotation (see RotateCA): it rewrites dir's ca.crt to hold only
// this CA's certificate, so that certificates of the previous CAs are no longer trusted
// by handshakes that begin more than the reload interval later. Connections already
// established are not affected.
func (ca *CA) FinishRotation(dir string) error {
	ca.trusted = []*x509.Certificate{ca.cert}
	return writeFileAtomic(filepath.Join(dir, CACertFile), ca.bundlePEM(), 0o644)
}

// Issue writes a certificate and key for identity to dir, as <identity>.crt (0644) and
// <identity>.key (0600), replacing any there: a rotation, which the identity's Source
// picks up without a restart. The certificate is valid for validFor
// (DefaultCertValidity when not positive, and never beyond the CA's own expiry), for
// both server and client authentication. Its SANs are the URI
// spiffe://curfew.local/<identity> (the identity the mesh checks), the DNS names
// localhost and <identity>, the IPs 127.0.0.1 and ::1, and each of hosts (an IP or a DNS
// name), so that tools verifying a host name (grpcurl, grpc-health-probe) accept it too.
func (ca *CA) Issue(dir, identity string, validFor time.Duration, hosts ...string) error {
	if err := checkIdentity(identity); err != nil {
		return err
	}
	if validFor <= 0 {
		validFor = DefaultCertValidity
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("meshtls: %w", err)
	}
	serial, err := randomSerial()
	if err != nil {
		return err
	}
	now := time.Now()
	notAfter := now.Add(validFor)
	if notAfter.After(ca.cert.NotAfter) {
		notAfter = ca.cert.NotAfter
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{Organization: []string{"curfew"}, CommonName: identity},
		NotBefore:             now.Add(-ClockSkew),
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
		URIs:                  []*url.URL{idURI(identity)},
		DNSNames:              []string{"localhost", identity},
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
	}
	for _, h := range hosts {
		switch ip := net.ParseIP(h); {
		case ip != nil:
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		case h != "":
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		return fmt.Errorf("meshtls: issue %s: %w", identity, err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("meshtls: %w", err)
	}
	// Each file is replaced atomically; between the two renames a Source sees a key that
	// does not match its certificate and keeps serving the previous pair.
	if err := writeKey(filepath.Join(dir, identity+".key"), key); err != nil {
		return err
	}
	return writeFileAtomic(filepath.Join(dir, identity+".crt"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
}

// newCA creates a CA valid for validFor, in memory.
func newCA(validFor time.Duration) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("meshtls: %w", err)
	}
	serial, err := randomSerial()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		// The serial in the name tells a rotation's CAs apart in ca.crt.
		Subject:               pkix.Name{Organization: []string{"curfew"}, CommonName: fmt.Sprintf("curfew mesh CA %s %.8x", now.UTC().Format(time.DateOnly), serial.Bytes())},
		NotBefore:             now.Add(-ClockSkew),
		NotAfter:              now.Add(validFor),
		IsCA:                  true,
		BasicConstraintsValid: true,
		MaxPathLenZero:        true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("meshtls: create CA: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("meshtls: create CA: %w", err)
	}
	return &CA{cert: cert, key: key, trusted: []*x509.Certificate{cert}}, nil
}

// loadCA reads the CA in dir: the key in ca.key, and among ca.crt's certificates the CA
// certificate of that key.
func loadCA(dir string) (*CA, error) {
	keyPEM, err := os.ReadFile(filepath.Join(dir, CAKeyFile)) //nolint:gosec // the CA directory the operator names
	if err != nil {
		return nil, fmt.Errorf("meshtls: %w", err)
	}
	key, err := parseKey(keyPEM)
	if err != nil {
		return nil, fmt.Errorf("meshtls: %s: %w", filepath.Join(dir, CAKeyFile), err)
	}
	certPEM, err := os.ReadFile(filepath.Join(dir, CACertFile)) //nolint:gosec // the CA directory the operator names
	if err != nil {
		return nil, fmt.Errorf("meshtls: %w", err)
	}
	trusted, err := parseCAs(certPEM)
	if err != nil {
		return nil, fmt.Errorf("meshtls: %s: %w", filepath.Join(dir, CACertFile), err)
	}
	for _, c := range trusted {
		if pub, ok := c.PublicKey.(*ecdsa.PublicKey); ok && pub.Equal(key.Public()) {
			return &CA{cert: c, key: key, trusted: trusted}, nil
		}
	}
	return nil, fmt.Errorf("meshtls: %s holds no certificate of the key in %s", filepath.Join(dir, CACertFile), CAKeyFile)
}

// write writes the CA's key and then its certificates to dir.
func (ca *CA) write(dir string) error {
	if err := writeKey(filepath.Join(dir, CAKeyFile), ca.key); err != nil {
		return err
	}
	return writeFileAtomic(filepath.Join(dir, CACertFile), ca.bundlePEM(), 0o644)
}

// bundlePEM returns the PEM of the trusted CA certificates, the CA's own first.
func (ca *CA) bundlePEM() []byte {
	var b bytes.Buffer
	_ = pem.Encode(&b, &pem.Block{Type: "CERTIFICATE", Bytes: ca.cert.Raw})
	for _, c := range ca.trusted {
		if !c.Equal(ca.cert) {
			_ = pem.Encode(&b, &pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})
		}
	}
	return b.Bytes()
}

// parseCAs parses the PEM certificates of a ca.crt: at least one, each a CA.
func parseCAs(data []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for {
		var b *pem.Block
		b, data = pem.Decode(data)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, err
		}
		if !c.IsCA {
			return nil, fmt.Errorf("certificate %q is not a CA", c.Subject.CommonName)
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		return nil, errors.New("no PEM certificate")
	}
	return out, nil
}

// parseKey parses a PEM ECDSA private key, PKCS #8 or SEC 1.
func parseKey(data []byte) (*ecdsa.PrivateKey, error) {
	b, _ := pem.Decode(data)
	if b == nil {
		return nil, errors.New("no PEM private key")
	}
	if k, err := x509.ParsePKCS8PrivateKey(b.Bytes); err == nil {
		if ek, ok := k.(*ecdsa.PrivateKey); ok {
			return ek, nil
		}
		return nil, fmt.Errorf("private key is a %T, not ECDSA", k)
	}
	return x509.ParseECPrivateKey(b.Bytes)
}

// writeKey writes key as PKCS #8 PEM, 0600.
func writeKey(path string, key *ecdsa.PrivateKey) error {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return fmt.Errorf("meshtls: %w", err)
	}
	return writeFileAtomic(path, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600)
}

// writeFileAtomic writes data to path with perm through a temporary file in the same
// directory and a rename, so that a reader sees either the old or the new contents.
func writeFileAtomic(path string, data []byte, perm fs.FileMode) (err error) {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*.tmp")
	if err != nil {
		return fmt.Errorf("meshtls: %w", err)
	}
	defer func() {
		if err != nil {
			_ = f.Close()
			_ = os.Remove(f.Name())
			err = fmt.Errorf("meshtls: write %s: %w", path, err)
		}
	}()
	if err := f.Chmod(perm); err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}

// randomSerial returns a random positive 127-bit serial number.
func randomSerial() (*big.Int, error) {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("meshtls: %w", err)
	}
	return n.Add(n, big.NewInt(1)), nil
}
