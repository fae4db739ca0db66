// cniclient drives CNI plugins through libcni exactly as containerd does:
// AddNetworkList, CheckNetworkList and DelNetworkList on a conflist, with
// libcni's result cache. It is test tooling for `make conformance`, built
// offline in GOPATH mode against Debian's libcni source.
//
//	cniclient [flags] add|check|del CONFLIST NETNS CONTAINER_ID
//	cniclient [flags] burst-add|burst-del CONFLIST NETNS_PREFIX COUNT
//
// add prints the addresses of the result, one per line (CIDR notation);
// burst-add runs COUNT concurrent ADDs, container "burst-I" in netns
// /var/run/netns/NETNS_PREFIX-I, and prints every address; burst-del undoes it.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	types100 "github.com/containernetworking/cni/pkg/types/100"
)

var (
	pluginPath = flag.String("path", "/usr/lib/cni", "plugin directories, ':'-separated (CNI_PATH)")
	cacheDir   = flag.String("cache", "", "libcni result cache directory")
	ifName     = flag.String("ifname", "eth0", "interface name in the container")
	timeout    = flag.Duration("timeout", 60*time.Second, "bound on the whole command")
)

func main() {
	flag.Parse()
	args := flag.Args()
	if len(args) != 4 {
		fail("usage: cniclient [flags] add|check|del CONFLIST NETNS CONTAINER_ID | burst-add|burst-del CONFLIST NETNS_PREFIX COUNT")
	}
	list, err := libcni.ConfListFromFile(args[1])
	if err != nil {
		fail("loading %s: %v", args[1], err)
	}
	cni := libcni.NewCNIConfigWithCacheDir(strings.Split(*pluginPath, ":"), *cacheDir, nil)
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	switch args[0] {
	case "add", "check", "del":
		out, err := run(ctx, cni, list, args[0], args[2], args[3])
		if err != nil {
			fail("%s: %v", args[0], err)
		}
		for _, line := range out {
			fmt.Println(line)
		}
	case "burst-add", "burst-del":
		count, err := strconv.Atoi(args[3])
		if err != nil || count < 1 {
			fail("bad COUNT %q", args[3])
		}
		burst(ctx, cni, list, strings.TrimPrefix(args[0], "burst-"), args[2], count)
	default:
		fail("unknown command %q", args[0])
	}
}

func runtimeConf(netns, containerID string) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{
		ContainerID: containerID,
		NetNS:       netns,
		IfName:      *ifName,
		// What containerd sends (toCNILabels).
		Args: [][2]string{
			{"IgnoreUnknown", "1"},
			{"K8S_POD_NAMESPACE", "conformance"},
			{"K8S_POD_NAME", containerID},
			{"K8S_POD_INFRA_CONTAINER_ID", containerID},
			{"K8S_POD_UID", "uid-" + containerID},
		},
	}
}

// run does one verb and returns the result's addresses (ADD only).
func run(ctx context.Context, cni *libcni.CNIConfig, list *libcni.NetworkConfigList, verb, netns, containerID string) ([]string, error) {
	rt := runtimeConf(netns, containerID)
	switch verb {
	case "add":
		result, err := cni.AddNetworkList(ctx, list, rt)
		if err != nil {
			return nil, err
		}
		return addresses(result)
	case "check":
		return nil, cni.CheckNetworkList(ctx, list, rt)
	default:
		return nil, cni.DelNetworkList(ctx, list, rt)
	}
}

// addresses converts the result (in the conflist's version) to the current
// shape, as runtimes do, and lists its addresses.
func addresses(result types.Result) ([]string, error) {
	current, err := types100.NewResultFromResult(result)
	if err != nil {
		return nil, fmt.Errorf("converting the result: %v", err)
	}
	if len(current.IPs) == 0 {
		return nil, fmt.Errorf("the result has no address")
	}
	var out []string
	for _, ip := range current.IPs {
		out = append(out, ip.Address.String())
	}
	return out, nil
}

// burst runs one verb for count containers at once.
func burst(ctx context.Context, cni *libcni.CNIConfig, list *libcni.NetworkConfigList, verb, prefix string, count int) {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var all, failures []string
	for i := 0; i < count; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			netns := fmt.Sprintf("/var/run/netns/%s-%d", prefix, i)
			out, err := run(ctx, cni, list, verb, netns, fmt.Sprintf("burst-%d", i))
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				failures = append(failures, fmt.Sprintf("burst-%d: %v", i, err))
			}
			all = append(all, out...)
		}(i)
	}
	wg.Wait()
	sort.Strings(all)
	for _, line := range all {
		fmt.Println(line)
	}
	if len(failures) > 0 {
		fail("%d of %d %s failed: %s", len(failures), count, verb, strings.Join(failures, "; "))
	}
}

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "cniclient: "+format+"\n", args...)
	os.Exit(1)
}
