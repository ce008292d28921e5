# Build targets. `make deb` builds the Debian package (as root on Debian 12: it installs the
# build dependencies with apt) and leaves it in dist/.

BUILD_DEPENDS := debhelper dh-virtualenv devscripts build-essential python3-all python3-dev \
	python3-venv

.PHONY: deb
deb:
	@# only what is missing, so a machine that has them builds offline
	set -e; missing=; \
	for package in $(BUILD_DEPENDS); do \
	  dpkg-query -W -f='$${Status}' $$package 2>/dev/null | grep -q "ok installed" \
	    || missing="$$missing $$package"; \
	done; \
	if [ -n "$$missing" ]; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get update -q; \
	  apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=300 $$missing; \
	fi
	dpkg-buildpackage -us -uc -b
	@# dpkg-buildpackage writes the package and its .buildinfo and .changes to the parent
	@# directory; move this version's files into dist/.
	mkdir -p dist
	set -e; \
	  name="logbroker_$$(dpkg-parsechangelog -S Version)_$$(dpkg-architecture -qDEB_HOST_ARCH)"; \
	  mv ../$$name.deb ../$$name.buildinfo ../$$name.changes dist/; \
	  echo "built dist/$$name.deb"

# The certification (docs/certification.md): three nodes in network namespaces, every drill,
# the six guarantees. As root on Debian 12; installs what it needs first.
.PHONY: certify
certify:
	scripts/install --test
	.venv/bin/python -m tests.certify

# The soak (docs/certification.md): the drills in a loop at random for DURATION seconds (at
# least 100 SIGKILLs of a primary), 1,000 idle topics beside the load; its report is written
# into docs/certification.md.
DURATION ?= 3600
.PHONY: soak
soak:
	scripts/install --test
	.venv/bin/python -m tests.certify.soak --duration $(DURATION) --report
