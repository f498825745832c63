package registry

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"os"
)

// TLSConfig is a grpc source's TLS. The server's certificate is verified against
// CAFile's roots (the system's when empty) for ServerName (the address's host when
// empty); CertFile and KeyFile, both or neither, are the client certificate sent to a
// server that asks for one (mTLS). The files are read when the source is opened, so a
// source opened again after a failure uses the files as they are then.
type TLSConfig struct {
	CAFile, CertFile, KeyFile, ServerName string
}

type tlsJSON struct {
	CAFile     string `json:"ca_file"`
	CertFile   string `json:"cert_file"`
	KeyFile    string `json:"key_file"`
	ServerName string `json:"server_name"`
}

// parseTLS checks a source's tls object: the files it names are read now, so that a
// file that is missing or not PEM stops toolrunner at start, naming the field.
func parseTLS(raw json.RawMessage, path string) (*TLSConfig, error) {
	var j tlsJSON
	if err := strict(raw, &j, path); err != nil {
		return nil, err
	}
	t := &TLSConfig{CAFile: j.CAFile, CertFile: j.CertFile, KeyFile: j.KeyFile, ServerName: j.ServerName}
	if (t.CertFile == "") != (t.KeyFile == "") {
		field := "key_file"
		if t.CertFile == "" {
			field = "cert_file"
		}
		return nil, fmt.Errorf("%s.%s: cert_file and key_file go together: set both for a client certificate, or neither", path, field)
	}
	if _, err := t.clientConfig(path); err != nil {
		return nil, err
	}
	return t, nil
}

// ClientConfig returns the tls.Config of the source's connection, reading the files.
// Errors name the field (tls.ca_file, tls.cert_file).
func (t *TLSConfig) ClientConfig() (*tls.Config, error) { return t.clientConfig("tls") }

func (t *TLSConfig) clientConfig(path string) (*tls.Config, error) {
	c := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: t.ServerName}
	if t.CAFile != "" {
		pem, err := os.ReadFile(t.CAFile)
		if err != nil {
			return nil, fmt.Errorf("%s.ca_file: %w", path, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%s.ca_file: %s holds no PEM certificate", path, t.CAFile)
		}
		c.RootCAs = pool
	}
	if t.CertFile != "" {
		pair, err := tls.LoadX509KeyPair(t.CertFile, t.KeyFile)
		if err != nil {
			var pe *os.PathError
			if errors.As(err, &pe) && pe.Path == t.KeyFile {
				return nil, fmt.Errorf("%s.key_file: %w", path, err)
			}
			return nil, fmt.Errorf("%s.cert_file: %w", path, err)
		}
		c.Certificates = []tls.Certificate{pair}
	}
	return c, nil
}
