package app

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

// writeCert writes a self-signed certificate for 127.0.0.1 named cn, and its key, to the two
// paths, and returns it.
func writeCert(t *testing.T, certPath, keyPath, cn string) *x509.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, BasicConstraintsValid: true, IsCA: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kb, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyPath, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kb}), 0o600); err != nil {
		t.Fatal(err)
	}
	c, _ := x509.ParseCertificate(der)
	return c
}

// Baton serves its API over TLS with smg's --tls-cert-path and --tls-key-path (on whichever
// HTTP server the suite runs), refuses plain HTTP on that port, and serves a certificate renewed
// in its files without a restart.
func TestServesTLSAndRereadsTheCertificate(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	dir := t.TempDir()
	certPath, keyPath := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	first := writeCert(t, certPath, keyPath, "first")
	file := filepath.Join(dir, "baton.yaml")
	if err := os.WriteFile(file, []byte(fmt.Sprintf("worker_urls: [%s]\n", e.URL())), 0o600); err != nil {
		t.Fatal(err)
	}
	args := []string{"--config", file, "--watch-config", "--tls-cert-path", certPath, "--tls-key-path", keyPath}
	if v := testHTTPServer(); v != "" {
		args = append(args, "--http-server", v)
	}
	r := startRun(t, args...)
	if !strings.HasPrefix(r.api, "https://") {
		t.Fatalf("serving on %s", r.api)
	}
	// served is the certificate the API presents with a 200 answer, nil until it answers 200.
	served := func() *x509.Certificate {
		t.Helper()
		client := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}, Timeout: 10 * time.Second}
		defer client.CloseIdleConnections()
		resp, err := client.Post(r.api+"/v1/completions", "application/json", strings.NewReader(`{"model":"m","prompt":"hi","max_tokens":2}`))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		_, _ = io.ReadAll(resp.Body)
		if resp.StatusCode != 200 {
			return nil
		}
		return resp.TLS.PeerCertificates[0]
	}
	poll.Until(t, "an answer over TLS", func() bool { return served() != nil })
	if c := served(); !c.Equal(first) {
		t.Errorf("served %s, want the configured certificate", c.Subject.CommonName)
	}
	if resp, err := http.Get(strings.Replace(r.api, "https://", "http://", 1) + "/v1/models"); err == nil {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == 200 {
			t.Errorf("plain HTTP on the TLS port answered 200: %s", b)
		}
	}
	// Renewed in place (cert-manager rewriting its Secret): the files' change is a reload.
	second := writeCert(t, certPath, keyPath, "second")
	poll.Until(t, "the renewed certificate served", func() bool { c := served(); return c != nil && c.Equal(second) })
	// A renewal that cannot be read keeps the certificate served, and the reload says so (a
	// partial reload, not "applied"); a reload that leaves a model unservable says which.
	if err := os.WriteFile(certPath, []byte("not a certificate"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, []byte(fmt.Sprintf("worker_urls: [%s]\nmodels:\n  gpt4: {serve: gpt-4-typo}\n", e.URL())), 0o600); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the reload's warnings", func() bool {
		l := r.logs.String()
		return strings.Contains(l, "not the TLS certificate") && strings.Contains(l, `gpt-4-typo\" (served for gpt4)`)
	})
	if c := served(); c == nil || !c.Equal(second) {
		t.Error("a certificate that could not be read replaced the one served")
	}
	// A certificate file replaced by a link to a device that never ends is neither read whole
	// by the watcher nor by a reload: the one served stays, and the process keeps answering.
	os.Remove(certPath)
	if err := os.Symlink("/dev/zero", certPath); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(file, []byte(fmt.Sprintf("worker_urls: [%s]\n", e.URL())), 0o600) // a reload too
	poll.Until(t, "the reload that cannot read the certificate", func() bool { return strings.Contains(r.logs.String(), "is not a regular file") })
	if c := served(); c == nil || !c.Equal(second) {
		t.Error("after the certificate became /dev/zero: not served with the one before")
	}
}

// newCA makes a certificate authority named cn, its certificate written to path.
func newCA(t *testing.T, path, cn string) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageCertSign, BasicConstraintsValid: true, IsCA: true}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// signedCert is a certificate for cn signed by ca, for a client (ExtKeyUsageClientAuth) or a
// server on 127.0.0.1.
func signedCert(t *testing.T, ca tls.Certificate, cn string, client bool) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	parent, err := x509.ParseCertificate(ca.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	usage := x509.ExtKeyUsageServerAuth
	if client {
		usage = x509.ExtKeyUsageClientAuth
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour), IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, ca.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// The picker's gRPC port with the operator's certificate and a client CA: a data plane without a
// client certificate, or with one another CA signed, is refused at the handshake; the gateway
// holding one signed by the CA is served; the health port answers the kubelet in plaintext.
func TestEPPMutualTLS(t *testing.T) {
	e := simEngine(t, sim.Config{Engine: sim.EngineVLLM})
	dir := t.TempDir()
	certPath, keyPath := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	caPath := filepath.Join(dir, "ca.crt")
	server := writeCert(t, certPath, keyPath, "picker")
	ca, other := newCA(t, caPath, "gateway-ca"), newCA(t, filepath.Join(dir, "other.crt"), "other-ca")

	cfg := testConfig(e.URL())
	cfg.EPP = true
	g, _ := startGateway(t, cfg)
	c := g.Config
	c.Host, c.GRPCPort, c.GRPCHealthPort = "127.0.0.1", 0, 0
	c.EPPSecureServing, c.EPPTLSCertPath, c.EPPTLSKeyPath, c.EPPClientCAPath = true, certPath, keyPath, caPath
	el, err := g.listenEPP(c)
	if err != nil {
		t.Fatal(err)
	}
	el.serve()
	ctx, cancel := context.WithCancel(context.Background())
	go el.watch(ctx)
	t.Cleanup(func() { cancel(); el.stop(time.Now()) })

	roots := x509.NewCertPool()
	roots.AddCert(server)
	check := func(certs []tls.Certificate) error {
		conn, err := grpc.NewClient(el.ln.Addr().String(), grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: roots, Certificates: certs})))
		if err != nil {
			return err
		}
		defer conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		_, err = healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "liveness"})
		return err
	}
	if err := check(nil); err == nil {
		t.Error("a data plane without a client certificate was served")
	}
	if err := check([]tls.Certificate{signedCert(t, other, "intruder", true)}); err == nil {
		t.Error("a client certificate of another CA was accepted")
	}
	if err := check([]tls.Certificate{signedCert(t, ca, "gateway", true)}); err != nil {
		t.Errorf("the gateway's certificate: %v", err)
	}
	hconn, err := grpc.NewClient(el.hln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer hconn.Close()
	poll.Until(t, "the plaintext health port answers readiness", func() bool {
		r, err := healthpb.NewHealthClient(hconn).Check(context.Background(), &healthpb.HealthCheckRequest{Service: "readiness"})
		return err == nil && r.GetStatus() == healthpb.HealthCheckResponse_SERVING
	})

	// The certificate files replaced (a cert-manager renewal): the port serves the new one.
	go el.watchCert(ctx, 20*time.Millisecond)
	client := signedCert(t, ca, "gateway", true)
	served := func() string {
		conn, err := tls.Dial("tcp", el.ln.Addr().String(), &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}, Certificates: []tls.Certificate{client}})
		if err != nil {
			return ""
		}
		defer conn.Close()
		return conn.ConnectionState().PeerCertificates[0].Subject.CommonName
	}
	if cn := served(); cn != "picker" {
		t.Fatalf("served %q before the renewal", cn)
	}
	writeCert(t, certPath, keyPath, "picker-renewed")
	poll.Until(t, "the renewed certificate is served", func() bool { return served() == "picker-renewed" })
}
