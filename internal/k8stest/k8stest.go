// Package k8stest runs a real etcd and kube-apiserver on loopback for Baton's Kubernetes tests.
// The binaries come from scripts/k8s-test-binaries.sh (built once from the Go module proxy into
// a cache directory); there is no kubelet, scheduler or controller, so tests play the kubelet
// by patching pod status through the status subresource.
package k8stest

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// Version is the Kubernetes release the script builds; HelmVersion the helm release.
const (
	Version     = "v1.35.4"
	HelmVersion = "v3.22.0"
)

// cacheBase is the scripts' cache directory: $XDG_CACHE_HOME/baton, else ~/.cache/baton.
func cacheBase() string {
	base := os.Getenv("XDG_CACHE_HOME")
	if base == "" {
		home, _ := os.UserHomeDir()
		base = filepath.Join(home, ".cache")
	}
	return filepath.Join(base, "baton")
}

// Helm returns the helm binary the script builds ($HELM_BIN, else its cache), "" when absent.
func Helm() string {
	p := os.Getenv("HELM_BIN")
	if p == "" {
		p = filepath.Join(cacheBase(), "helm", HelmVersion, "helm")
	}
	if st, err := os.Stat(p); err != nil || st.Mode()&0o111 == 0 {
		return ""
	}
	return p
}

// Assets returns the directory holding etcd and kube-apiserver: $KUBE_TEST_ASSETS, else the
// script's cache directory; "" when the binaries are not there.
func Assets() string {
	dir := os.Getenv("KUBE_TEST_ASSETS")
	if dir == "" {
		dir = os.Getenv("KUBE_TEST_CACHE")
		if dir == "" {
			dir = filepath.Join(cacheBase(), "k8s-test", Version)
		}
	}
	for _, b := range []string{"etcd", "kube-apiserver"} {
		if st, err := os.Stat(filepath.Join(dir, b)); err != nil || st.Mode()&0o111 == 0 {
			return ""
		}
	}
	return dir
}

// Require returns the shared server, or skips the test loudly when the binaries are absent —
// and fails it instead where BATON_REQUIRE_K8S is set (CI builds them, so CI never skips).
func Require(t testing.TB, s *Server) *Server {
	t.Helper()
	if s != nil {
		return s
	}
	msg := "SKIPPED: no etcd/kube-apiserver/helm binaries; run scripts/k8s-test-binaries.sh (about 9 minutes, once) to run the tests against a real API server"
	if os.Getenv("BATON_REQUIRE_K8S") != "" {
		t.Fatal("BATON_REQUIRE_K8S is set but " + msg)
	}
	t.Skip(msg)
	return nil
}

// Server is a running etcd and kube-apiserver.
type Server struct {
	Config *rest.Config
	// Kubeconfig is a kubeconfig file for the server (for Baton's --kubeconfig).
	Kubeconfig string

	dir, assets      string
	etcd, apiserver  *proc
	apiPort, etcdURL string
	token            string
}

// Start starts etcd and kube-apiserver from assets and waits until the API server is ready and
// its default namespace exists.
func Start(ctx context.Context, assets string) (*Server, error) {
	dir, err := os.MkdirTemp("", "baton-k8stest-")
	if err != nil {
		return nil, err
	}
	s := &Server{dir: dir, assets: assets, token: "baton-test-token"}
	if err := s.start(ctx); err != nil {
		s.Stop()
		return nil, err
	}
	return s, nil
}

func (s *Server) start(ctx context.Context) error {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return err
	}
	files := map[string][]byte{
		"sa.key":     pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}),
		"sa.pub":     pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}),
		"tokens.csv": []byte(s.token + `,admin,admin,"system:masters"` + "\n"),
	}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(s.dir, name), b, 0o600); err != nil {
			return err
		}
	}
	ports, err := freePorts(3)
	if err != nil {
		return err
	}
	s.etcdURL = "http://127.0.0.1:" + strconv.Itoa(ports[0])
	peer := "http://127.0.0.1:" + strconv.Itoa(ports[1])
	s.apiPort = strconv.Itoa(ports[2])
	if s.etcd, err = s.run("etcd", "--name=test", "--data-dir="+filepath.Join(s.dir, "etcd"),
		"--listen-client-urls="+s.etcdURL, "--advertise-client-urls="+s.etcdURL,
		"--listen-peer-urls="+peer, "--initial-advertise-peer-urls="+peer, "--initial-cluster=test="+peer,
		"--unsafe-no-fsync", "--log-level=warn"); err != nil {
		return err
	}
	if err := s.StartAPIServer(ctx); err != nil {
		return err
	}
	s.Kubeconfig = filepath.Join(s.dir, "kubeconfig")
	return os.WriteFile(s.Kubeconfig, []byte(fmt.Sprintf(`apiVersion: v1
kind: Config
clusters: [{name: test, cluster: {server: %q, insecure-skip-tls-verify: true}}]
users: [{name: test, user: {token: %q}}]
contexts: [{name: test, context: {cluster: test, user: test}}]
current-context: test
`, s.Config.Host, s.token)), 0o600)
}

// StartAPIServer starts kube-apiserver (again, after StopAPIServer: same port, same etcd, same
// data) and waits until it is ready.
func (s *Server) StartAPIServer(ctx context.Context) error {
	var err error
	s.apiserver, err = s.run("kube-apiserver",
		"--etcd-servers="+s.etcdURL, "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
		"--secure-port="+s.apiPort, "--cert-dir="+filepath.Join(s.dir, "certs"),
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+filepath.Join(s.dir, "sa.pub"),
		"--service-account-signing-key-file="+filepath.Join(s.dir, "sa.key"),
		"--service-cluster-ip-range=10.0.0.0/24", "--authorization-mode=AlwaysAllow",
		"--token-auth-file="+filepath.Join(s.dir, "tokens.csv"),
		// No controller creates the default service account, and the kubernetes Service's
		// endpoint cannot be a loopback address.
		"--disable-admission-plugins=ServiceAccount", "--endpoint-reconciler-type=none")
	if err != nil {
		return err
	}
	s.Config = &rest.Config{Host: "https://127.0.0.1:" + s.apiPort, BearerToken: s.token,
		TLSClientConfig: rest.TLSClientConfig{Insecure: true}, QPS: -1}
	cs, err := kubernetes.NewForConfig(s.Config)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(90 * time.Second)
	for {
		body, err := cs.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		if err == nil && string(body) == "ok" {
			if _, err := cs.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{}); err == nil {
				return nil
			}
		}
		if s.apiserver.exited() || time.Now().After(deadline) {
			return fmt.Errorf("kube-apiserver not ready (its log: %s): %v", filepath.Join(s.dir, "kube-apiserver.log"), err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// StopAPIServer stops kube-apiserver, leaving etcd (and the cluster's state) as it is.
func (s *Server) StopAPIServer() { stop(s.apiserver) }

// Stop stops both and removes their files.
func (s *Server) Stop() {
	stop(s.apiserver)
	stop(s.etcd)
	if os.Getenv("BATON_K8STEST_KEEP") == "" {
		_ = os.RemoveAll(s.dir)
	}
}

// proc is a started binary; done closes when it has exited.
type proc struct {
	cmd  *exec.Cmd
	done chan struct{}
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (s *Server) run(name string, args ...string) (*proc, error) {
	log, err := os.OpenFile(filepath.Join(s.dir, name+".log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o600)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(filepath.Join(s.assets, name), args...)
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = dieWithParent() // never outlive the tests (where the platform allows)
	if err := cmd.Start(); err != nil {
		log.Close()
		return nil, err
	}
	p := &proc{cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); log.Close(); close(p.done) }()
	return p, nil
}

func stop(p *proc) {
	if p == nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

func freePorts(n int) ([]int, error) {
	var out []int
	var lns []net.Listener
	defer func() {
		for _, l := range lns {
			l.Close()
		}
	}()
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		lns = append(lns, l)
		out = append(out, l.Addr().(*net.TCPAddr).Port)
	}
	return out, nil
}

// Main runs a test package's tests with a shared server in *s when the binaries exist (nil
// otherwise: Require skips or fails each test). It returns the exit code.
func Main(m *testing.M, s **Server) int {
	if dir := Assets(); dir != "" {
		srv, err := Start(context.Background(), dir)
		if err != nil {
			fmt.Fprintln(os.Stderr, "k8stest:", err)
			return 1
		}
		*s = srv
		defer srv.Stop()
	} else {
		fmt.Fprintln(os.Stderr, "k8stest: SKIPPING the real-API-server tests: no etcd/kube-apiserver; run scripts/k8s-test-binaries.sh")
	}
	return m.Run()
}
