package app

import (
	"crypto/tls"
	"fmt"
	"net"
	"sync/atomic"

	"github.com/baton-llm/baton/internal/config"
)

// certificate is the API's TLS certificate, read from its files at startup and again on every
// reload — a reload follows a change of the files themselves too — so that a renewed
// certificate (cert-manager rewriting a mounted Secret) is served to the next connection without
// a restart. A reload whose files do not load keeps the one served.
type certificate struct {
	certPath, keyPath string
	current           atomic.Pointer[tls.Certificate]
}

// load reads the certificate and key files.
func (c *certificate) load() error {
	certPEM, err := config.ReadFile(c.certPath, config.MaxSmallFile)
	if err != nil {
		return fmt.Errorf("tls: %w", err)
	}
	keyPEM, err := config.ReadFile(c.keyPath, config.MaxSmallFile)
	if err != nil {
		return fmt.Errorf("tls: %w", err)
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return fmt.Errorf("tls: %w", err)
	}
	c.current.Store(&cert)
	return nil
}

// sum is the SHA-256 of the certificate and key files' content together, nil when either
// cannot be read: what the reload watcher compares.
func (c *certificate) sum() []byte {
	a, b := fileSum(c.certPath), fileSum(c.keyPath)
	if a == nil || b == nil {
		return nil
	}
	return append(a, b...)
}

// listener serves TLS on ln with the current certificate (HTTP/1.1: both of Baton's HTTP
// servers speak it).
func (c *certificate) listener(ln net.Listener) net.Listener {
	return tls.NewListener(ln, &tls.Config{
		MinVersion: tls.VersionTLS12,
		NextProtos: []string{"http/1.1"},
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return c.current.Load(), nil
		},
	})
}
